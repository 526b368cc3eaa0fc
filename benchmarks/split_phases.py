r"""Where one ``ssar_split_allgather`` call spends its time and CPU, phase by phase, per rank.

Issue 35, item 1: run as the ranks of a torch.distributed job, this wraps the
algorithm's steps (paper 000, sec. 5.3.2) with a clock and with the process's
CPU time (every thread: gloo's included) and prints, for each rank, the median
over ``--calls`` calls (after a barrier each) of

* ``total``: the whole ``sparse_allreduce`` call;
* ``1 split+reduce``: steps 1-2 (encode the pieces, the all-to-all, decode and sum
  this rank's range); ``1a alltoallv``: the all-to-all alone;
* ``3 allgather``: the recursive-doubling allgather of the reduced ranges;
* ``4 decode``: decoding the gathered ranges into the result.

    sparcml cluster -P 8 --rate 1gbit -- \
        .venv/bin/python benchmarks/split_phases.py -N 16M -d 0.00781 --index-coding auto
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import sparcml.collectives.ssar_split_allgather as split_allgather
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.compress.selection import k_of
from sparcml.tools.cli.common import size_arg

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--calls", type=int, default=9)
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

    split_allgather.split_and_reduce = timed("1 split+reduce", split_allgather.split_and_reduce)
    split_allgather.allgather_buffers = timed("3 allgather", split_allgather.allgather_buffers)
    split_allgather.decode_ranges = timed("4 decode", split_allgather.decode_ranges)
    comm.alltoallv = timed("1a alltoallv", comm.alltoallv)  # type: ignore[method-assign]
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    stream = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)

    def call() -> None:
        sparse_allreduce(stream, comm, "ssar_split_allgather", index_coding=args.index_coding)

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
        print(f"P={p} N={n:,} k={k:,} index_coding={args.index_coding}: p50 ms per rank")
        for key in sorted(medians):
            cells = " ".join(f"{m[key]:7.1f}" for m in every if m is not None)
            print(f"{key[0]:<5} {key[1]:<15} {cells}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
