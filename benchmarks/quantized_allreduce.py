"""The quantized allreduce of the training recipes, with and without two issue-13 changes.

P local gloo processes reduce one float32 gradient of ``-N`` elements with
``dsar_split_allgather`` under ``natural`` (``quantize="all"``: what the
``natural`` training method runs), next to gloo's dense ``all_reduce``. The
quantized call runs in two configurations, alternating call by call:

* ``now``: as the library ships;
* ``before``: with the allgather forced onto gloo's ring (``DIRECT_ALLGATHER_BYTES
  = 0``) and the header's NaN/Inf check done with ``torch.isfinite(x).all()``,
  as before the direct allgather and ``all_finite``.

Reported: the slowest rank's time per call after a barrier, median over
``--calls`` (the first three of each are warm-up).

    .venv/bin/python benchmarks/quantized_allreduce.py -P 4 -N 180000 --calls 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from sparcml import SparseStream, sparse_allreduce
from sparcml.collectives import allreduce as allreduce_module
from sparcml.comm import torchdist
from sparcml.compress import get
from sparcml.finite import all_finite

WARMUP = 3
SHIPPED_DIRECT_BYTES = torchdist.DIRECT_ALLGATHER_BYTES


def _isfinite_all(values: torch.Tensor) -> bool:
    return values.numel() == 0 or bool(torch.isfinite(values).all())


def _configure(before: bool) -> None:
    torchdist.DIRECT_ALLGATHER_BYTES = 0 if before else SHIPPED_DIRECT_BYTES
    allreduce_module.all_finite = _isfinite_all if before else all_finite  # type: ignore[attr-defined]


def _rank(comm: torchdist.TorchDistCommunicator, n: int, calls: int) -> dict[str, list[float]]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
    q = get("natural")

    def quantized() -> torch.Tensor:
        return sparse_allreduce(
            SparseStream.dense(x),
            comm,
            algorithm="dsar_split_allgather",
            quantizer=q,
            quantize="all",
        ).to_dense()

    def dense() -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    cases = {"gloo dense all_reduce": (None, dense)}
    cases["natural, now"] = (False, quantized)
    cases["natural, before"] = (True, quantized)
    times: dict[str, list[float]] = {name: [] for name in cases}
    results = {}
    for call in range(WARMUP + calls):
        order = list(cases) if call % 2 == 0 else list(reversed(cases))
        for name in order:
            before, fn = cases[name]
            if before is not None:
                _configure(before)
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if call >= WARMUP:
                times[name].append(dt)
            results[name] = out
    _configure(False)
    # both configurations round with the quantizer's generator: equal inputs and
    # draws give equal results only call by call, so check agreement across ranks
    digest = torch.tensor([float(results["natural, now"].double().sum())], dtype=torch.float64)
    sums = comm.allgather(digest)
    if any(not torch.equal(s, sums[0]) for s in sums):
        raise AssertionError("ranks disagree on the quantized result")
    return times


def main() -> None:
    from sparcml.comm.launch import run_processes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", type=int, default=4, help="world size")
    ap.add_argument("-N", type=int, default=180_000, help="float32 elements")
    ap.add_argument("--calls", type=int, default=40, help="timed calls per case")
    args = ap.parse_args()
    per_rank = run_processes(args.P, _rank, args.N, args.calls, timeout=120.0, deadline=1800.0)
    print(f"P={args.P} N={args.N:,} float32, slowest rank per call, median of {args.calls}")
    for name in per_rank[0]:
        slowest = [max(r[name][i] for r in per_rank) for i in range(args.calls)]
        print(f"{name:24s} {1e3 * statistics.median(slowest):8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
