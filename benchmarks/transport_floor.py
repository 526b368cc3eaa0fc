"""What the transport alone takes for the bytes of one call, next to sparcml's calls.

Issue 13: the dense baseline of ``sparcml bench`` on the emulated cluster is
bimodal (about 1.1 s or 2.2 s per 64 MB allreduce at P = 8, 1 Gbit/s), and the
"x dense" ratios depend on which mode the dense row lands in. This script, run
as the ranks of a torch.distributed job (``sparcml cluster ... --``), times in
one process group the slowest rank per call of each row below, the rows in
turn, ``--calls`` rounds (:class:`Rounds`: the dense rows among themselves, then
the sparse ones), and prints the ratios of their p50s:

* the plain gloo ``all_reduce`` of ``N`` float32 in place, of a fresh clone,
  through :meth:`TorchDistCommunicator.allreduce` and through
  ``sparse_allreduce(..., algorithm="dense")`` (a fresh dense vector per call);
* the plain gloo collectives that carry the split allgather's bytes:
  ``all_to_all_single`` of the split phase and ``all_gather_into_tensor`` of the
  reduced ranges (sizes from the density: the index fields the default coding
  sends, :func:`sparcml.indexcode.index_field_nbytes`, and float32 values),
  next to ``sparse_allreduce(..., algorithm="ssar_split_allgather")`` itself on
  uniform random indices, with the default index coding and with
  ``index_coding="fixed"``;
* the same for recursive doubling (P a power of two): the ``log2 P`` rounds of
  ``isend``/``irecv`` between partners, each of the expected size of the
  partial sum it carries, next to ``ssar_recursive_double``.

    sudo .venv/bin/sparcml cluster -P 8 --rate 1gbit -- \\
        .venv/bin/python benchmarks/transport_floor.py -N 16M -d 0.00781
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.compress.selection import k_of
from sparcml.indexcode import index_field_nbytes
from sparcml.tools.cli.common import size_arg


def slowest_rank_timer(calls: int) -> Callable[[str, Callable[[], object]], float]:
    """``timeit(name, fn)``: ``fn`` once untimed, then ``calls`` times after a barrier
    each; rank 0 prints the slowest rank's p50, min and max; every rank returns that
    p50 in ms (also used by ``alltoallv_eager.py``)."""
    rank = dist.get_rank()

    def timeit(name: str, fn: Callable[[], object]) -> float:
        fn()  # warm-up
        times = []
        for _ in range(calls):
            dist.barrier()
            t = time.perf_counter()
            fn()
            worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times.append(float(worst) * 1e3)
        if rank == 0:
            print(
                f"{name:<56} p50 {statistics.median(times):8.1f} ms"
                f"  min {min(times):8.1f}  max {max(times):8.1f}",
                flush=True,
            )
        return statistics.median(times)

    return timeit


def gloo_job(doc: str, calls: int) -> tuple[argparse.Namespace, TorchDistCommunicator]:
    """Parse ``-N``, ``-d``, ``--calls`` (default ``calls``), join the gloo job (one
    thread per rank), and return the arguments and the job's communicator (also used
    by ``dense_baseline.py``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--calls", type=int, default=calls)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return args, TorchDistCommunicator()


class Rounds:
    """Rows timed in alternation: every round runs each row once, after a barrier
    each, and records the slowest rank's seconds. A job's p50s then share its
    drifts (the link's, the machine's); rows timed in blocks of calls moved by as
    much as the algorithms differ (docs/cluster.md). The dense rows alternate among
    themselves and the sparse rows among themselves: a sparse call right after a
    67 MB allreduce ran slower than in a round of sparse calls."""

    def __init__(self) -> None:
        self.rows: dict[str, Callable[[], object]] = {}
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, fn: Callable[[], object]) -> str:
        self.rows[name] = fn
        return name

    def run(self, rounds: int) -> dict[str, float]:
        """Warm every row once, then ``rounds`` rounds; rank 0 prints each row's p50,
        min and max (ms); every rank returns the p50s."""
        for fn in self.rows.values():
            fn()
        self.times = {name: [] for name in self.rows}
        for _ in range(rounds):
            for name, fn in self.rows.items():
                dist.barrier()
                t = time.perf_counter()
                fn()
                worst = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                self.times[name].append(float(worst) * 1e3)
        p50 = {name: statistics.median(ts) for name, ts in self.times.items()}
        if dist.get_rank() == 0:
            for name, ts in self.times.items():
                print(
                    f"{name:<56} p50 {p50[name]:8.1f} ms  min {min(ts):8.1f}  max {max(ts):8.1f}",
                    flush=True,
                )
        return p50


def main() -> None:
    args, comm = gloo_job(__doc__, calls=5)
    p, me = comm.world_size, comm.rank
    n, k = args.size, k_of(args.density, args.size)
    if me == 0:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
        print(
            f"P={p} N={n:,} k={k:,} per rank, THP_MEM_ALLOC_ENABLE={thp}, "
            f"{args.calls} rounds of every row in turn",
            flush=True,
        )
    x = torch.randn(n)
    rows = dense_rows = Rounds()
    in_place = rows.add(
        f"gloo all_reduce in place ({4 * n / 1e6:.1f} MB)", lambda: dist.all_reduce(x)
    )
    rows.add("gloo all_reduce of a fresh clone", lambda: dist.all_reduce(x.clone()))
    rows.add("TorchDistCommunicator.allreduce", lambda: comm.allreduce(x))
    g = torch.Generator().manual_seed(me)
    idx = torch.randperm(n, generator=g)[:k]
    stream = SparseStream(idx, torch.randn(k, generator=g), n)
    dense = rows.add(
        "sparse_allreduce(algorithm='dense')", lambda: sparse_allreduce(stream, comm, "dense")
    )
    # the split allgather's bytes: k pairs cut into P pieces, then the reduced ranges
    rows = Rounds()
    width, d = n // p, args.density
    reduced = round(width * (1 - (1 - d) ** p))  # expected union of one range

    def pairs_nbytes(size: int, nnz: int) -> int:  # a message's index field and values
        return index_field_nbytes(size, nnz) + 4 * nnz

    piece = torch.zeros(pairs_nbytes(width, k // p), dtype=torch.uint8)
    split_in, split_out = piece.repeat(p), torch.empty(p * piece.numel(), dtype=torch.uint8)
    mine = torch.zeros(pairs_nbytes(width, reduced), dtype=torch.uint8)
    gathered = torch.empty(p * mine.numel(), dtype=torch.uint8)
    # torch 2.13 renamed all_gather_into_tensor (the old name warns)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    split_floor = [
        rows.add(
            f"gloo all_to_all_single, {piece.numel() * (p - 1) / 1e6:.2f} MB out",
            lambda: dist.all_to_all_single(split_out, split_in),
        ),
        rows.add(
            f"gloo all_gather_into_tensor, {mine.numel() / 1e6:.2f} MB per rank",
            lambda: all_gather(gathered, mine),
        ),
    ]
    split = {
        coding: rows.add(
            f"sparse_allreduce(algorithm='ssar_split_allgather'), {coding}",
            lambda coding=coding: sparse_allreduce(
                stream, comm, "ssar_split_allgather", index_coding=coding
            ),
        )
        for coding in ("auto", "fixed")
    }
    doubling: dict[str, str] = {}
    doubling_floor = ""
    if p & (p - 1) == 0 and p > 1:
        # recursive doubling: round t sends the partial sum of 2^(t-1) ranks' k pairs
        rounds = p.bit_length() - 1
        sizes = [round(n * (1 - (1 - d) ** (1 << t))) for t in range(rounds)]
        sends = [torch.zeros(pairs_nbytes(n, m), dtype=torch.uint8) for m in sizes]
        recvs = [torch.empty_like(b) for b in sends]

        def exchanges() -> None:
            for t in range(rounds):
                peer = me ^ (1 << t)
                # the receive first: gloo sends a body once its receive is posted, and
                # one posted after the own send's body waits for all of it
                reqs = [dist.irecv(recvs[t], peer), dist.isend(sends[t], peer)]
                for r in reqs:
                    r.wait()

        total = sum(b.numel() for b in sends) / 1e6
        doubling_floor = rows.add(
            f"gloo isend/irecv of recursive doubling's rounds, {total:.2f} MB out", exchanges
        )
        doubling = {
            coding: rows.add(
                f"sparse_allreduce(algorithm='ssar_recursive_double'), {coding}",
                lambda coding=coding: sparse_allreduce(
                    stream, comm, "ssar_recursive_double", index_coding=coding
                ),
            )
            for coding in ("auto", "fixed")
        }
    p50 = {**dense_rows.run(args.calls), **rows.run(args.calls)}
    if me == 0:  # the ratios of p50s measured above, in this job
        ratios = [("algorithm='dense' / gloo in place", p50[dense], p50[in_place])]
        floor = sum(p50[r] for r in split_floor)
        for coding, row in split.items():
            ratios.append((f"ssar_split_allgather, {coding} / its floor", p50[row], floor))
            ratios.append(
                (f"gloo in place / ssar_split_allgather, {coding}", p50[in_place], p50[row])
            )
        for coding, row in doubling.items():
            ratios.append(
                (f"ssar_recursive_double, {coding} / its floor", p50[row], p50[doubling_floor])
            )
            ratios.append(
                (f"gloo in place / ssar_recursive_double, {coding}", p50[in_place], p50[row])
            )
        print("ratios of the p50s above (issue 35: a sparse call at most 1.2x its floor):")
        for what, a, b in ratios:
            print(f"  {what:<52} {a / b:6.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
