r"""The dense baseline against gloo's own allreduce, interleaved call by call.

Issue 35, item 3: ``sparse_allreduce(..., algorithm="dense")`` should cost what
gloo's in-place ``all_reduce`` costs. It returns a fresh vector (the caller's
tensor is never written), so each call writes 4N bytes of fresh memory that gloo
in place does not: the densified stream (zeros, then the pairs) or a dense
stream's copy. Run as the ranks of a torch.distributed job (``sparcml cluster
... --``), this times, in rounds (one call of each row per round, after a barrier
each; the slowest rank's time), ``--calls`` rounds after one untimed round:

* ``gloo in place``: ``dist.all_reduce`` of a tensor the rank holds (the floor);
* ``gloo, fresh clone``: ``dist.all_reduce(x.clone())`` (a fresh result);
* ``densify, then allreduce``: the dense algorithm's own work for a sparse stream
  (``comm.allreduce(stream.to_dense(), donate=True)``), without
  ``sparse_allreduce``'s consistency check;
* ``dense, sparse stream`` / ``dense, dense stream``: ``sparse_allreduce(...,
  algorithm="dense")`` for a stream of ``d N`` uniform random pairs and for a
  dense stream (copied, never written);
* ``pieces while writing``: what the library does not do (tried, measured no
  gain: docs/cluster.md): the fresh vector written piece by piece (pieces
  doubling from N/64), each piece handed to gloo (``async_op``) as soon as it is
  written, so gloo's threads reduce it while the next is written (compare with
  ``densify, then allreduce``).

    sparcml cluster -P 8 --rate 1gbit -- \
        .venv/bin/python benchmarks/dense_baseline.py -N 16M -d 0.00781 --calls 15
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transport_floor import gloo_job  # this folder, on sys.path when run as a script

from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.compress.selection import k_of


def main() -> None:
    args, comm = gloo_job(__doc__, calls=9)
    p, me = comm.world_size, comm.rank
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    idx = torch.randperm(n, generator=g)[:k]
    stream = SparseStream(idx, torch.randn(k, generator=g), n)
    dense = SparseStream.dense(torch.randn(n, generator=g))
    x = torch.randn(n, generator=g)
    cuts, size = [0], n // 64
    while n - cuts[-1] > 3 * size:
        cuts.append(cuts[-1] + size)
        size *= 2
    cuts.append(n)
    at = torch.searchsorted(stream.indices, torch.tensor(cuts)).tolist()

    def pieces_while_writing() -> torch.Tensor:
        out = torch.empty(n)
        works = []
        for i in range(len(cuts) - 1):
            part = out[cuts[i] : cuts[i + 1]]
            part.zero_()
            part[stream.indices[at[i] : at[i + 1]] - cuts[i]] = stream.values[at[i] : at[i + 1]]
            works.append(dist.all_reduce(part, async_op=True))
        for w in works:
            w.wait()
        return out

    rows: dict[str, Callable[[], object]] = {
        "gloo in place": lambda: dist.all_reduce(x),
        "gloo, fresh clone": lambda: dist.all_reduce(x.clone()),
        "densify, then allreduce": lambda: comm.allreduce(stream.to_dense(), donate=True),
        "dense, sparse stream": lambda: sparse_allreduce(stream, comm, "dense"),
        "dense, dense stream": lambda: sparse_allreduce(dense, comm, "dense"),
        f"pieces while writing ({len(cuts) - 1})": pieces_while_writing,
    }
    if me == 0:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
        print(
            f"P={p} N={n:,} ({4 * n / 1e6:.1f} MB) k={k:,} per rank, {args.calls} rounds "
            f"after 1 untimed, rows interleaved; THP_MEM_ALLOC_ENABLE={thp}",
            flush=True,
        )
    times: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(args.calls + 1):
        for name, fn in rows.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if r:
                times[name].append(float(worst) * 1e3)
    if me == 0:
        floor = statistics.median(times["gloo in place"])
        print(f"{'row (slowest rank, ms)':34s} {'p50':>9s} {'p25-p75':>17s} {'min':>8s} "
              f"{'max':>8s} {'vs in place':>11s}")  # fmt: skip
        for name, v in times.items():
            q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
            mid = statistics.median(v)
            print(
                f"{name:34s} {mid:9.2f} {q[0]:8.2f}-{q[2]:8.2f} {min(v):8.2f} {max(v):8.2f} "
                f"{mid / floor:10.3f}x",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
