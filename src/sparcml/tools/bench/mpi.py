"""``sparcml bench-mpi``: the dense path over :class:`~sparcml.comm.MPICommunicator`
next to mpi4py's own ``Allreduce``, in one ``mpirun`` job.

Per size, round robin (so load changes on a shared machine hit all alike):

* ``sparcml``: ``MPICommunicator.allreduce(x)`` (returns a fresh tensor, as every
  collective of the library does);
* ``mpi4py``: ``comm.Allreduce(x, out)`` into a buffer allocated once, the fastest
  use of MPI from Python;
* ``mpi4py, fresh out``: the same call into a buffer allocated per call.

Every figure is the median over the repeats of the slowest rank's time (each call
starts after a barrier). Run as ``mpirun -np 4 sparcml bench-mpi``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ...comm.mpi import MPICommunicator

__all__ = ["dense_rows"]


def dense_rows(
    comm: MPICommunicator, sizes: list[int], repeats: int = 10, warmup: int = 2
) -> list[dict[str, Any]]:
    """One row per size: median ms of the three ways (slowest rank per call)."""
    from mpi4py import MPI

    mpi = comm.mpi
    rows = []

    def ours(x: torch.Tensor, out: torch.Tensor) -> None:
        comm.allreduce(x)

    def theirs(x: torch.Tensor, out: torch.Tensor) -> None:
        mpi.Allreduce(x.numpy(), out.numpy(), op=MPI.SUM)

    def theirs_fresh(x: torch.Tensor, out: torch.Tensor) -> None:
        fresh = torch.empty_like(x)
        mpi.Allreduce(x.numpy(), fresh.numpy(), op=MPI.SUM)

    ways = {"sparcml": ours, "mpi4py": theirs, "mpi4py_fresh_out": theirs_fresh}
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        out = torch.empty_like(x)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for rep in range(warmup + repeats):
            for name, fn in ways.items():
                mpi.Barrier()
                t0 = time.perf_counter()
                fn(x, out)
                dt = time.perf_counter() - t0
                if rep >= warmup:
                    times[name].append(mpi.allreduce(dt, op=MPI.MAX))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append(
            {
                "N": n,
                "bytes": n * x.element_size(),
                **{f"{k}_ms": v for k, v in ms.items()},
                "ratio": ms["sparcml"] / ms["mpi4py"],
                "ratio_fresh_out": ms["sparcml"] / ms["mpi4py_fresh_out"],
            }
        )
    return rows
