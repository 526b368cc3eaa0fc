r"""Sums of two sorted runs merged and added in one compiled pass (now) or by positions
then ``index_add_`` per run (before), in whole sparse allreduce calls alternating
round by round, on the ranks of a torch.distributed job.

Issue 35, item 1: every sparse sum of two streams (the split phase's pieces at
P = 2, every stage of recursive doubling, the error feedback's accumulations) went
through :func:`sparcml.merge.merge_positions` and then one ``index_add_`` per run;
float32/float64 sums on the CPU now write the union and the sums in the same pass
(``cpu_kernels.merge2_sum``, the same bits). Every round runs each algorithm both
ways, after a barrier each, ``--rounds`` times; rank 0 prints the slowest rank's
p25, p50 and p75 per variant and the ratio of the p50s, then the sum of the split
phase's two pieces alone on its core, both ways (p50 of ``--rounds`` each), and
the load average. Uniform random indices, the default index coding, explicit calls.

    sparcml cluster -P 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/merge_fused.py -N 16M -d 0.00781 --rounds 41
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from own_range import rounds_job  # this folder, on sys.path when run as a script

import sparcml.merge as merge
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.collectives._common import partition_boundaries

#: the variants: which value dtypes the fused two-run sum takes
VARIANTS = {"one pass (now)": merge._FUSED, "positions + index_add_ (before)": ()}
ALGORITHMS = ("ssar_split_allgather", "ssar_recursive_double")


def main() -> None:
    args, comm, stream, g = rounds_job(__doc__)
    n, k = stream.size, stream.nnz
    keys = [(alg, name) for alg in ALGORITHMS for name in VARIANTS]
    for alg in ALGORITHMS:  # warm-up, and the same bits both ways
        got = []
        for name in VARIANTS:
            merge._FUSED = VARIANTS[name]
            got.append(sparse_allreduce(stream, comm, alg))
        assert got[0].equal(got[1]), f"{alg}: the two variants differ"
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for _ in range(args.rounds):
        for alg, name in keys:
            merge._FUSED = VARIANTS[name]
            dist.barrier()
            t = time.perf_counter()
            sparse_allreduce(stream, comm, alg)
            worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[alg, name].append(float(worst) * 1e3)
    # the split phase's sum alone: this rank's piece and a second rank's, as at P = 2
    bounds = partition_boundaries(n, 2)
    other = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n).split(
        bounds
    )[0]
    mine = stream.split(bounds)[0]
    step: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, fused in VARIANTS.items():
            merge._FUSED = fused
            t = time.perf_counter()
            SparseStream.sum([mine, other])
            step[name].append((time.perf_counter() - t) * 1e3)
    merge._FUSED = VARIANTS["one pass (now)"]
    if comm.rank == 0:
        print(f"P={comm.world_size} N={n:,} k={k:,} per rank, {args.rounds} rounds, same bits")
        for alg in ALGORITHMS:
            p50 = {}
            for name in VARIANTS:
                q1, p50[name], q3 = statistics.quantiles(times[alg, name], n=4)
                print(f"{alg} {name:<32} ms: p25 {q1:6.2f}  p50 {p50[name]:6.2f}  p75 {q3:6.2f}")
            before, now = p50["positions + index_add_ (before)"], p50["one pass (now)"]
            print(f"{alg} before / now (p50s) {before / now:5.2f}x")
        print(f"the sum of two pieces of {mine.nnz:,} and {other.nnz:,} entries alone (rank 0):")
        for name, ts in step.items():
            print(f"  {name:<32} ms: p50 {statistics.median(ts):6.3f}")
        print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
