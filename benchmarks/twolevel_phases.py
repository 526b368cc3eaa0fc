r"""Where one two-level call spends its time and CPU, step by step, per rank.

Issue 31: run as the ranks of a torch.distributed job on nodes (``sparcml cluster
--nodes N --ranks-per-node L``), this wraps ``twolevel_shard``'s steps with a clock
and the process's user and system CPU time (``getrusage``: every thread, gloo's
included) and prints, for each rank, the median over ``--calls`` calls (after a
barrier each) of

* ``0 total``: the whole ``sparse_allreduce`` call (the header exchange included);
* ``1 split``: step 1, the reduce-scatter inside the node;
* ``2 inner``: step 2, the shard's allreduce between nodes;
* ``3 allgather``: step 3's allgather of the reduced shards inside the node;
* ``4 decode``: step 3's decoding of the gathered shards into the result.

``--index-coding elias-fano`` codes every message with Elias--Fano (what ``auto``
did inside the node before it sent the fixed fields there); ``auto`` is the default.

    sparcml cluster --nodes 2 --ranks-per-node 4 --rate 1gbit -- \
        .venv/bin/python benchmarks/twolevel_phases.py -N 16M -d 0.00781 --index-coding auto
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import sparcml.collectives.twolevel_shard as shard
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.compress.selection import k_of
from sparcml.tools.cli.common import size_arg


def _usage(field: str) -> Callable[[], float]:
    return lambda: float(getattr(resource.getrusage(resource.RUSAGE_SELF), field))


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "user": _usage("ru_utime"),
    "sys": _usage("ru_stime"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--index-coding", default="auto")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    p, me = dist.get_world_size(), dist.get_rank()
    comm = TorchDistCommunicator()
    spent: dict[tuple[str, str], list[float]] = {}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            start = {c: clock() for c, clock in CLOCKS.items()}
            out = fn(*a, **kw)
            for c, clock in CLOCKS.items():
                spent.setdefault((c, key), []).append(clock() - start[c])
            return out

        return run

    inner = shard.get_algorithm
    shard.split_and_reduce = timed("1 split", shard.split_and_reduce)
    shard.get_algorithm = lambda name: timed("2 inner", inner(name))
    shard.allgather_buffers = timed("3 allgather", shard.allgather_buffers)
    shard.decode_ranges = timed("4 decode", shard.decode_ranges)
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    stream = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)

    def call() -> None:
        sparse_allreduce(stream, comm, "twolevel_shard", index_coding=args.index_coding)

    for _ in range(2):
        call()
    spent.clear()
    total = timed("0 total", call)
    for _ in range(args.calls):
        dist.barrier()
        total()
    medians = {key: statistics.median(v) * 1e3 for key, v in spent.items()}
    every: list[dict[tuple[str, str], float] | None] = [None] * p
    dist.all_gather_object(every, medians)
    if me == 0:
        print(f"P={p} {comm.topology} N={n:,} k={k:,} index_coding={args.index_coding}: "
              "p50 ms per rank")  # fmt: skip
        for key in sorted(medians):
            cells = " ".join(f"{m.get(key, 0.0):7.1f}" for m in every if m is not None)
            print(f"{key[0]:<5} {key[1]:<12} {cells}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
