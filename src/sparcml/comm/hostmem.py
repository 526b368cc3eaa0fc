"""Host memory for large CPU buffers: transparent huge pages for PyTorch's CPU allocator.

Every collective returns fresh tensors (results, received messages, decoded
streams), and a fresh CPU buffer of more than a few MB is ``mmap``-ed memory that
the kernel zero-fills one 4 KiB page fault at a time on first touch: allocating
and filling a large buffer costs several times refilling one already mapped,
often more than the work done in it.

PyTorch's CPU allocator aligns allocations of 2 MB and more to 2 MB and asks the
kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) when the
environment variable ``THP_MEM_ALLOC_ENABLE=1`` is set (read once, at the
process's first such allocation): 512 times fewer page faults. Memory cost:
large buffers round up to 2 MB. The measured effect on the dense path over MPI,
with the variable on and off, is in docs/benchmarks.md ("The dense path over MPI").

The ``sparcml`` command and the processes it starts set it (unless the
environment already says otherwise); a training script started by ``torchrun`` or
``mpirun`` should export it too (README, "THP_MEM_ALLOC_ENABLE") or call
:func:`enable_huge_pages` before it creates its model.

Freed memory kept for reuse (:func:`keep_freed_memory`). glibc's allocator
serves blocks of 128 KiB and more with their own ``mmap`` and gives them back at
``free``, and trims the top of its heap once 128 KiB of it are free (the first
threshold rises with the blocks freed, up to 32 MiB, the second to twice it):
blocks over 32 MiB and trimming stay, and a training step that frees and
allocates its gradients, activations and messages again every step then
zero-fills every page of them again, one fault at a time. With the thresholds
raised (blocks up to 256 MiB from the heap, the heap trimmed only past 1 GiB
free) the pages stay mapped and are reused (docs/training.md, "Freed memory kept
for reuse", has training steps with and without). Memory cost: a process keeps
up to its peak heap.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

__all__ = ["MALLOC_VARIABLES", "VARIABLE", "device_memory_bytes", "enable_huge_pages",
           "keep_freed_memory"]  # fmt: skip

log = logging.getLogger(__name__)

VARIABLE = "THP_MEM_ALLOC_ENABLE"

#: glibc's allocator settings :func:`keep_freed_memory` gives (read by glibc when a
#: process starts): blocks up to 256 MiB from the heap, which is trimmed only past
#: 1 GiB free
MALLOC_VARIABLES = {"MALLOC_MMAP_THRESHOLD_": 256 << 20, "MALLOC_TRIM_THRESHOLD_": 1 << 30}
#: ``mallopt`` parameters of those settings (glibc's malloc.h)
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
#: ``SPARCML_MALLOC=system`` leaves glibc's settings as they are
OPT_OUT = "SPARCML_MALLOC"
# glibc refused the settings in this process: not tried again
_refused = False


def enable_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the environment sets it; True if it is on.

    Effective only before the process's first CPU allocation of 2 MB or more
    (PyTorch reads the variable once); inherited by processes started afterwards
    (:func:`~sparcml.comm.launch.run_processes` spawns its ranks when it changed since
    its fork server started).
    """
    os.environ.setdefault(VARIABLE, "1")
    return os.environ[VARIABLE] not in ("", "0")


def keep_freed_memory() -> bool:
    """Keep freed host memory mapped for reuse (see the module docstring).

    Applies :data:`MALLOC_VARIABLES` to this process with glibc's ``mallopt`` and
    sets them in the environment, for processes started afterwards; True if it
    did. Leaves everything as it is (False) where the environment already sets one
    of them (a process started with them has them already) or ``GLIBC_TUNABLES``
    sets the allocator's, where ``SPARCML_MALLOC=system``, off glibc, and where
    glibc refuses the settings (before 2.35 it takes no mmap threshold above 32
    MiB; a warning says so).
    """
    global _refused
    if os.environ.get(OPT_OUT, "") == "system" or _refused:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in MALLOC_VARIABLES) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False  # the user's own settings
    try:
        mallopt = ctypes.CDLL(None).mallopt  # (glibc's symbols are the program's)
    except (OSError, AttributeError) as e:
        log.debug("freed memory not kept: no mallopt here (%s)", e)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # the mmap threshold first: glibc before 2.35 refuses one above 32 MiB, and the
    # trim threshold alone would switch its own adaptive mmap threshold off
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if mallopt(_MALLOPT[key], MALLOC_VARIABLES[key]) != 1:
            _refused = True  # (said once)
            log.warning("freed memory not kept for reuse: this glibc refuses %s=%d "
                        "(its own settings stay)", key, MALLOC_VARIABLES[key])  # fmt: skip
            return False
    for key, value in MALLOC_VARIABLES.items():
        os.environ[key] = str(value)  # for the processes started from here
    return True


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory a tensor on ``device`` can at most take: the machine's physical
    memory for the CPU, the GPU's total memory for CUDA; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
