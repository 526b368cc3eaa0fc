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
"""

from __future__ import annotations

import os

import torch

__all__ = ["VARIABLE", "device_memory_bytes", "enable_huge_pages"]

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def enable_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the environment sets it; True if it is on.

    Effective only before the process's first CPU allocation of 2 MB or more
    (PyTorch reads the variable once); inherited by processes started afterwards
    (:func:`~sparcml.comm.launch.run_processes` spawns its ranks when it changed since
    its fork server started).
    """
    os.environ.setdefault(VARIABLE, "1")
    return os.environ[VARIABLE] not in ("", "0")


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
