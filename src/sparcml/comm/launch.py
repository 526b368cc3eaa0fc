"""Local multi-process launcher: ranks as processes over gloo on loopback.

:func:`run_processes` is the process-based sibling of
:func:`sparcml.comm.run_ranks`: it starts ``world_size`` Python processes,
initialises a gloo process group among them on ``127.0.0.1``, runs
``fn(comm, *args)`` on each with a :class:`~sparcml.comm.TorchDistCommunicator`,
and returns the results in rank order. The demo, the benchmarks and the
real-transport tests use it; under ``torchrun`` or ``mpirun`` you do not need it.

``fn`` must be importable by the child processes (a module-level function).

The ranks start from a fork server (multiprocessing's ``forkserver`` start
method) that has imported :data:`PRELOAD` once: torch, ``torch._dynamo`` (which
an optimizer's constructor imports), numba and sparcml's training layer with its
compiled kernels loaded. A spawned rank imported all of that itself, about 5 s of
CPU on the 2-core machine, paid by every rank of the test suite's hundreds of
launches (``benchmarks/launch_cost.py`` measures both ways).

What a forked rank keeps from the server, and how the launcher deals with it:

* The environment: a rank restores the launcher's ``os.environ`` as it is at the
  launch, before it runs ``fn``. Variables read when a process starts or imports
  torch or numba (:data:`START_FIXED`: ``OMP_*``, ``TORCH_*``, ``NUMBA_*``,
  ``THP_MEM_ALLOC_ENABLE``, the allocator's and the loader's) would keep the
  server's values, so a launch whose values differ from those the server started
  with spawns its ranks instead. ``fn``'s own module is imported before the
  restore: a module-level read of another variable there sees the server's value.
* ``sparcml`` itself: the server imports it from its default ``sys.path``; a rank
  that finds it is not the launcher's copy raises, naming both paths
  (``start_method="spawn"`` runs the launcher's).
* Standard output and error are the file descriptors the launcher had when the
  server started (it starts at the first launch); the working directory and
  ``sys.path`` follow the launcher at each launch.
* Python's string hashing seed and NumPy's global random state are the server's,
  the same in every rank (spawned ranks draw their own).

``start_method="spawn"`` starts fresh interpreters instead.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.multiprocessing as mp

from .hostmem import enable_huge_pages, keep_freed_memory

__all__ = [
    "PRELOAD",
    "START_FIXED",
    "START_METHODS",
    "ProcessFailedError",
    "free_port",
    "run_processes",
]

log = logging.getLogger("sparcml")


class ProcessFailedError(RuntimeError):
    """A rank process raised, died or overran the launcher's deadline."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


#: a launch whose port another process took between probing and binding is retried
PORT_ATTEMPTS = 3

#: what the fork server imports once for every rank it starts: torch, the part of it
#: an optimizer imports on its first construction (torch._dynamo, about 2 s of CPU),
#: numba and sparcml's compiled kernels, loaded and run once (sparcml.torch.forkserver).
#: None of them starts a thread. A module that raises ImportError is skipped by the
#: server (the rank imports it as it would have anyway); sparcml.torch.forkserver
#: catches its own failures, so the server cannot die of one.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numba", "sparcml.torch.forkserver")

#: environment variables (prefixes) read when a process starts or imports torch or
#: numba: OpenMP's and MKL's thread pools, torch's and numba's configuration,
#: PyTorch's huge pages, glibc's allocator and loader, Python's own
START_FIXED = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_", "PYTORCH_", "NUMBA_", "THP_MEM_ALLOC_ENABLE",
    "MALLOC_", "GLIBC_", "LD_", "PYTHON",
)  # fmt: skip

# the START_FIXED variables the fork server started with (None: not started by us)
_server_fixed: dict[str, str] | None = None


def _fixed_at_start(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(START_FIXED)}


#: how :func:`run_processes` may start its ranks
START_METHODS = ("forkserver", "spawn")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take
    it before it is bound again: :func:`run_processes` retries on another port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float,
    threads: int,
    results: Any,
    backend: str = "gloo",
    environ: dict[str, str] | None = None,
    launcher_file: str | None = None,
) -> None:
    import torch.distributed as dist

    if environ is not None:  # the launcher's, at the launch (not the fork server's)
        os.environ.clear()
        os.environ.update(environ)

    # every rank on this host, as torchrun sets it: one node (comm.topology)
    os.environ.update(
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )

    from . import TorchDistCommunicator

    torch.set_num_threads(threads)
    try:
        here = os.path.abspath(__file__)
        if launcher_file is not None and here != launcher_file:
            raise RuntimeError(
                f"rank {rank} runs sparcml from {here}, the launcher from {launcher_file} "
                "(the fork server imports sparcml from its default sys.path): put the "
                "launcher's copy on PYTHONPATH, or run_processes(..., start_method='spawn')"
            )
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        except Exception as e:  # rank 0 could not bind the port: the launch is retried
            if rank == 0 and "address already in use" in str(e).lower():
                results.put((rank, None, b""))
                return
            raise
        comm = TorchDistCommunicator(timeout=timeout)
        try:
            out = fn(comm, *args)
        finally:
            comm.close()
        results.put((rank, True, _dumps(out)))
        dist.destroy_process_group()
    except BaseException as e:
        text = "".join(traceback.format_exception(e))
        results.put((rank, False, _dumps((type(e).__name__, str(e), text))))


def run_processes(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    deadline: float | None = None,
    threads: int = 1,
    allow_missing: bool = False,
    only: list[int] | None = None,
    backend: str = "gloo",
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` processes (gloo on loopback by default).

    Args:
        world_size: number of processes.
        fn: module-level function ``fn(comm, *args)``; its result must be picklable.
        timeout: the communicator's (and process group's) timeout, seconds.
        deadline: overall seconds before the launcher kills every rank
            (default ``timeout + 60``).
        threads: torch intra-op threads per rank.
        allow_missing: a rank that exits without a result gives ``None`` instead of
            an error (for tests that kill a rank on purpose).
        only: return once these ranks have reported; the others (a rank stopped on
            purpose) are killed and give ``None``.
        backend: the process group's backend: ``"gloo"``, or ``"nccl"`` (rank ``r``
            on CUDA device ``r`` modulo the device count).
        start_method: ``"forkserver"`` (ranks forked from a server that has imported
            :data:`PRELOAD` once) or ``"spawn"`` (every rank a fresh interpreter that
            imports everything itself; `benchmarks/launch_cost.py` compares the two).

    Raises:
        ProcessFailedError: a rank raised (its traceback is in the message), died
            without a result, or the deadline passed.
    """
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(START_METHODS)}, not {start_method!r}"
        )
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _launch(
                world_size, fn, args, timeout, deadline, threads, allow_missing, only, backend,
                start_method,
            )  # fmt: skip
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise ProcessFailedError(
                    f"rank 0 found its port taken {PORT_ATTEMPTS} times in a row", rank=0
                ) from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """Rank 0 could not bind the probed port (taken since the probe)."""


def _launch(
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float,
    deadline: float | None,
    threads: int,
    allow_missing: bool,
    only: list[int] | None,
    backend: str = "gloo",
    start_method: str = "forkserver",
) -> list[Any]:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
    # The ranks get this environment: keep them from oversubscribing the cores,
    # give their large buffers huge pages and keep their freed memory for reuse
    # (sparcml.comm.hostmem).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    enable_huge_pages()
    keep_freed_memory()
    global _server_fixed
    if start_method == "forkserver":
        fixed = _fixed_at_start(os.environ)
        if _server_fixed is None:
            _server_fixed = fixed  # the server starts with this launch
        elif fixed != _server_fixed:
            changed = sorted(k for k in fixed.keys() | _server_fixed.keys()
                             if fixed.get(k) != _server_fixed.get(k))  # fmt: skip
            log.info("run_processes: %s changed since the fork server started: ranks "
                     "spawned", ", ".join(changed))  # fmt: skip
            start_method = "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    results = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    me = os.path.abspath(__file__)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, timeout, threads, results, backend, environ, me),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + (deadline if deadline is not None else timeout + 60.0)
    got: dict[int, tuple[bool, bytes]] = {}
    try:
        while len(got) < world_size:
            if only is not None and all(r in got for r in only):
                break
            if not results.empty():
                rank, ok, blob = results.get()
                if ok is None:
                    raise _PortTaken()
                got[rank] = (ok, blob)
                continue
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive()
                and r not in got
                and not (allow_missing and p.exitcode)
                and (only is None or r in only)
            ]
            if allow_missing and all(
                r in got or (not p.is_alive() and p.exitcode) for r, p in enumerate(procs)
            ):
                break
            if dead and results.empty():
                time.sleep(0.2)  # a result may still be in flight
                if results.empty():
                    r = dead[0]
                    raise ProcessFailedError(
                        f"rank {r} died without a result (exit code {procs[r].exitcode})", rank=r
                    )
            if time.monotonic() > end:
                missing = sorted(set(range(world_size)) - set(got))
                raise ProcessFailedError(f"ranks {missing} did not finish before the deadline")
            time.sleep(0.01)
    finally:
        if only is not None:
            for r, p in enumerate(procs):
                if r not in only and p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    if failures:
        r = min(failures)
        name, msg, text = torch.load(io.BytesIO(failures[r]), weights_only=False)
        raise ProcessFailedError(f"rank {r} raised {name}: {msg}\n{text}", rank=r)
    return [
        torch.load(io.BytesIO(got[r][1]), weights_only=False) if r in got else None
        for r in range(world_size)
    ]
