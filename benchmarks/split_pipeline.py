r"""The pipelined split allgather next to the unpipelined one and to its floor, calls
alternating, on the ranks of a torch.distributed job.

Issue 35, item 1: a call of ``ssar_split_allgather`` jitters by several
milliseconds on the emulated cluster (the transport's own collectives by one or
two), so p50s of separate blocks of calls differ between jobs by more than
pipelining changes. Here every round runs, after a barrier each, the pipelined
call, the same call with one chunk per range
(:data:`~sparcml.collectives.ssar_split_allgather.PIPELINE_MIN_WIDTH` raised), and
its floor (gloo's ``all_to_all_single`` and ``all_gather_into_tensor`` moving the
same bytes, as ``benchmarks/transport_floor.py``), ``--rounds`` times, and rank 0
prints, for the slowest rank per call, each row's p25, p50, p75 and min, and the
ratios of the p50s. Uniform random indices, the default index coding.

    sparcml cluster -P 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/split_pipeline.py -N 16M -d 0.00781 --rounds 61
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import sparcml.collectives.ssar_split_allgather as split_allgather
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.compress.selection import k_of
from sparcml.indexcode import index_field_nbytes
from sparcml.tools.cli.common import size_arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--rounds", type=int, default=61)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    comm = TorchDistCommunicator()
    p, me = comm.world_size, comm.rank
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    idx = torch.randperm(n, generator=g)[:k]
    stream = SparseStream(idx, torch.randn(k, generator=g), n)
    # the floor's buffers: k pairs cut into P pieces, then the reduced ranges
    width, d = n // p, args.density
    reduced = round(width * (1 - (1 - d) ** p))
    piece = torch.zeros(index_field_nbytes(width, k // p) + 4 * (k // p), dtype=torch.uint8)
    split_in, split_out = piece.repeat(p), torch.empty(p * piece.numel(), dtype=torch.uint8)
    mine = torch.zeros(index_field_nbytes(width, reduced) + 4 * reduced, dtype=torch.uint8)
    gathered = torch.empty(p * mine.numel(), dtype=torch.uint8)
    chunked_from = split_allgather.PIPELINE_MIN_WIDTH

    def unpipelined() -> None:
        split_allgather.PIPELINE_MIN_WIDTH = n + 1
        try:
            sparse_allreduce(stream, comm, "ssar_split_allgather")
        finally:
            split_allgather.PIPELINE_MIN_WIDTH = chunked_from

    def floor() -> None:
        dist.all_to_all_single(split_out, split_in)
        dist.all_gather_into_tensor(gathered, mine)

    rows: dict[str, Callable[[], object]] = {
        "pipelined": lambda: sparse_allreduce(stream, comm, "ssar_split_allgather"),
        "unpipelined": unpipelined,
        "floor (gloo, same bytes)": floor,
    }
    chunks = split_allgather.chunk_count(n, p, split_allgather.EXACT)
    if me == 0:
        print(f"P={p} N={n:,} k={k:,} per rank, {chunks} chunk(s) per range pipelined", flush=True)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for fn in rows.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in rows.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[name].append(float(worst) * 1e3)
    if me == 0:
        p50 = {}
        for name, ts in times.items():
            q1, q2, q3 = statistics.quantiles(ts, n=4)
            p50[name] = q2
            print(f"{name:<26} ms: p25 {q1:6.2f}  p50 {q2:6.2f}  p75 {q3:6.2f}  min {min(ts):6.2f}")
        floor_p50 = p50["floor (gloo, same bytes)"]
        print(f"unpipelined / pipelined (p50s)   {p50['unpipelined'] / p50['pipelined']:5.2f}x")
        print(f"pipelined / floor (p50s)         {p50['pipelined'] / floor_p50:5.2f}x")
        print(f"unpipelined / floor (p50s)       {p50['unpipelined'] / floor_p50:5.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
