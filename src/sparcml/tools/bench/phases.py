"""Per-phase clocks for the phase benchmarks (``benchmarks/split_phases.py``,
``benchmarks/twolevel_phases.py``): wrap an algorithm's steps, time every call
of each on the wall clock and in the process's user and system CPU time
(``getrusage``: every thread, gloo's included), and tabulate the median per
rank.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CLOCKS", "Phases", "phase_job", "table"]


def _usage(field: str) -> Callable[[], float]:
    return lambda: float(getattr(resource.getrusage(resource.RUSAGE_SELF), field))


#: The clocks every phase is read on: wall, user CPU, system CPU (seconds).
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "user": _usage("ru_utime"),
    "sys": _usage("ru_stime"),
}


class Phases:
    """The seconds each wrapped function spent per call, on every clock."""

    def __init__(self) -> None:
        self.spent: dict[tuple[str, str], list[float]] = {}

    def timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with each call's seconds recorded under ``key`` on every clock."""

        def run(*a: Any, **kw: Any) -> Any:
            start = {c: clock() for c, clock in CLOCKS.items()}
            out = fn(*a, **kw)
            for c, clock in CLOCKS.items():
                self.spent.setdefault((c, key), []).append(clock() - start[c])
            return out

        return run

    def clear(self) -> None:
        """Forget what was recorded (after warm-up calls)."""
        self.spent.clear()

    def medians_ms(self) -> dict[tuple[str, str], float]:
        """The median milliseconds of each (clock, phase)."""
        return {key: statistics.median(v) * 1e3 for key, v in self.spent.items()}


def table(every: Sequence[dict[tuple[str, str], float] | None]) -> list[str]:
    """One line per (clock, phase), one column per rank, from every rank's
    :meth:`Phases.medians_ms` (gathered to one rank)."""
    ranks = [m for m in every if m is not None]
    keys = sorted({key for m in ranks for key in m})
    return [
        f"{c:<5} {phase:<15} " + " ".join(f"{m.get((c, phase), 0.0):7.1f}" for m in ranks)
        for c, phase in keys
    ]


def phase_job(
    doc: str, algorithm: str, wrap: Callable[[Phases, Any], None], calls: int = 9
) -> list[str] | None:
    """The body of a phase benchmark run as the ranks of a torch.distributed job:
    parse ``-N``, ``-d``, ``--calls``, ``--index-coding``; start gloo; let
    ``wrap(phases, comm)`` wrap the algorithm's steps with ``phases.timed``; call
    ``algorithm`` twice untimed on uniform random indices, then ``--calls`` times
    (after a barrier each) timed as ``0 total``; return the table on rank 0."""
    import argparse

    import torch
    import torch.distributed as dist

    from ...collectives import sparse_allreduce
    from ...comm import TopologyError, TorchDistCommunicator
    from ...compress.selection import k_of
    from ...stream import SparseStream
    from ..cli.common import size_arg

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--calls", type=int, default=calls)
    ap.add_argument("--index-coding", default="auto")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    p, me = dist.get_world_size(), dist.get_rank()
    comm = TorchDistCommunicator()
    phases = Phases()
    wrap(phases, comm)
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    stream = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)

    def call() -> None:
        sparse_allreduce(stream, comm, algorithm, index_coding=args.index_coding)

    for _ in range(2):
        call()
    phases.clear()
    total = phases.timed("0 total", call)
    for _ in range(args.calls):
        dist.barrier()
        total()
    every: list[dict[tuple[str, str], float] | None] = [None] * p
    dist.all_gather_object(every, phases.medians_ms())
    try:
        nodes = str(comm.topology)
    except TopologyError:  # irregular nodes (refused alike on every rank)
        nodes = "irregular nodes"
    head = f"P={p} {nodes} N={n:,} k={k:,} index_coding={args.index_coding}: p50 ms per rank"
    dist.destroy_process_group()
    return [head, *table(every)] if me == 0 else None
