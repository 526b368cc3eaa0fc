r"""``ssar_split_allgather`` with this rank's own range copied into the result (now)
or decoded from its own message (before), calls alternating, on the ranks of a
torch.distributed job.

Issue 35, item 1: the split allgather's last step decoded all ``P`` gathered
ranges, this rank's own among them, which it had just encoded from the stream it
holds. Now that stream is copied in (:func:`sparcml.collectives._common.decode_ranges`,
``own``). Every round runs both, after a barrier each, ``--rounds`` times; rank 0
prints the slowest rank's p25, p50 and p75 per variant and the ratio of the p50s,
then the last step alone on its core, both ways (the p50 of ``--rounds`` each).
Uniform random indices, the default index coding, an explicit call.

    sparcml cluster -P 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/own_range.py -N 16M -d 0.00781 --rounds 41
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import sparcml.collectives.ssar_split_allgather as split_allgather
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.compress.selection import k_of
from sparcml.tools.cli.common import size_arg


def rounds_job(
    doc: str,
) -> tuple[argparse.Namespace, TorchDistCommunicator, SparseStream, torch.Generator]:
    """Parse ``-N``, ``-d``, ``--rounds``; join the gloo job (one thread per rank);
    return the arguments, the communicator, this rank's stream of ``k = d N``
    uniform random indices and the generator that drew it (also used by
    ``merge_fused.py``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (quartiles of the rounds)")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    comm = TorchDistCommunicator()
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(comm.rank)
    idx = torch.randperm(n, generator=g)[:k]
    return args, comm, SparseStream(idx, torch.randn(k, generator=g), n), g


def main() -> None:
    args, comm, stream, _ = rounds_job(__doc__)
    n, k = stream.size, stream.nnz
    copied = split_allgather.decode_ranges

    def decoded(*a, **kw):  # type: ignore[no-untyped-def]
        return copied(*a[:6])  # without ``own``: every range decoded

    variants = {"own range copied (now)": copied, "own range decoded (before)": decoded}
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    for name, fn in variants.items():  # warm-up, and the same result both ways
        split_allgather.decode_ranges = fn
        results[name] = sparse_allreduce(stream, comm, "ssar_split_allgather")
    a, b = results.values()
    assert a.equal(b), "the two variants differ"
    for _ in range(args.rounds):
        for name, fn in variants.items():
            split_allgather.decode_ranges = fn
            dist.barrier()
            t = time.perf_counter()
            sparse_allreduce(stream, comm, "ssar_split_allgather")
            worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[name].append(float(worst) * 1e3)
    # the step alone, on this rank's core: the last call's gathered messages
    # decoded into the result both ways, alternating
    held: list[tuple] = []

    def keep(*a, **kw):  # type: ignore[no-untyped-def]
        held.append(a)
        return copied(*a, **kw)

    split_allgather.decode_ranges = keep
    sparse_allreduce(stream, comm, "ssar_split_allgather")
    split_allgather.decode_ranges = copied
    step: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn(*held[0])
            step[name].append((time.perf_counter() - t) * 1e3)
    if comm.rank == 0:
        print(f"P={comm.world_size} N={n:,} k={k:,} per rank, {args.rounds} rounds, same bits")
        p50 = {}
        for name, ts in times.items():
            q1, p50[name], q3 = statistics.quantiles(ts, n=4)
            print(f"{name:<28} ms: p25 {q1:6.2f}  p50 {p50[name]:6.2f}  p75 {q3:6.2f}")
        before, now = p50["own range decoded (before)"], p50["own range copied (now)"]
        print(f"before / now (p50s)          {before / now:5.2f}x")
        print("the last step alone (rank 0, its gathered messages into the result):")
        for name, ts in step.items():
            print(f"  {name:<28} ms: p50 {statistics.median(ts):6.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
