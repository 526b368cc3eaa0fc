"""Allgather on gloo: one direct all-to-all against torch.distributed's ring ``all_gather``.

Issue 13: the measurements behind ``DIRECT_ALLGATHER_BYTES`` in
``sparcml/comm/torchdist.py``. P local gloo processes; for each piece size, both
ways alternate call by call (the first calls of each are warm-up), a barrier
before each call, and the slowest rank's wall time per call is reported (median
over ``--calls``). "direct" is :meth:`TorchDistCommunicator.allgather` with the
threshold lifted past the largest size, "ring" is ``dist.all_gather``; each call's
result is checked against the pieces every rank sent.

    .venv/bin/python benchmarks/allgather_direct.py -P 4 8 --sizes 1K 45K 1M 8M
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from sparcml.comm import torchdist
from sparcml.comm.launch import run_processes
from sparcml.tools.cli.common import size_arg

WARMUP = 3


def _rank(comm: torchdist.TorchDistCommunicator, sizes: list[int], calls: int) -> dict:
    torchdist.DIRECT_ALLGATHER_BYTES = max(sizes)  # "direct" for every size here
    p, me = comm.world_size, comm.rank
    out: dict[int, dict[str, list[float]]] = {}
    for nbytes in sizes:
        piece = torch.full((nbytes,), me % 251, dtype=torch.uint8)
        want = [torch.full((nbytes,), r % 251, dtype=torch.uint8) for r in range(p)]
        times: dict[str, list[float]] = {"direct": [], "ring": []}
        for call in range(WARMUP + calls):
            for way in ("direct", "ring") if call % 2 == 0 else ("ring", "direct"):
                dist.barrier()
                t0 = time.perf_counter()
                if way == "direct":
                    got = comm.allgather(piece)
                else:
                    got = [torch.empty_like(piece) for _ in range(p)]
                    dist.all_gather(got, piece)
                dt = time.perf_counter() - t0
                if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                    raise AssertionError(f"{way} allgather of {nbytes} bytes: wrong pieces")
                if call >= WARMUP:
                    times[way].append(dt)
        out[nbytes] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", type=int, nargs="+", default=[4, 8], help="world sizes")
    ap.add_argument("--sizes", nargs="+", default=["1K", "45K", "1M", "8M"])
    ap.add_argument("--calls", type=int, default=20, help="timed calls per way and size")
    args = ap.parse_args()
    sizes = [size_arg(s) for s in args.sizes]
    print(f"{'P':>3} {'bytes/rank':>11} {'direct ms':>10} {'ring ms':>9} {'ring/direct':>12}")
    for p in args.P:
        per_rank = run_processes(p, _rank, sizes, args.calls, timeout=120.0, deadline=1800.0)
        for nbytes in sizes:
            med = {}
            for way in ("direct", "ring"):
                slowest = [max(r[nbytes][way][i] for r in per_rank) for i in range(args.calls)]
                med[way] = 1e3 * statistics.median(slowest)
            print(
                f"{p:>3} {nbytes:>11} {med['direct']:>10.2f} {med['ring']:>9.2f} "
                f"{med['ring'] / med['direct']:>12.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
