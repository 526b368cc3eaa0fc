r"""A sparse gradient's conversions to and from a stream, as every sparse-gradient
step makes them (issue 30, the lean step).

``nn.EmbeddingBag(F, 1, sparse=True)``'s gradient (the newsgroups recipe's with
``--recipe-option sparse=1``) reaches the pipeline as a COO tensor of shape
``(F, 1)`` with one sparse dimension; the pipeline reads it into a stream
(:meth:`SparseStream.from_torch_sparse`) and hands the average back as one
(:meth:`SparseStream.to_torch_sparse`). Prints the median and minimum of 7 batches
of ``--calls`` calls each, one thread, and the load average; run it once per
checkout to compare (``PYTHONPATH=<checkout>/src``).

    .venv/bin/python benchmarks/torch_sparse_convert.py --features 1M --nonzeros 12000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from sparcml import SparseStream


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _time(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    for _ in range(calls // 2):
        fn()
    batches = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(batches), min(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", type=_size, default=1 << 20)
    ap.add_argument("--nonzeros", type=int, default=12000)
    ap.add_argument("--width", type=int, default=1, help="the embedding's width")
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, m, w = args.features, args.nonzeros, args.width
    gen = torch.Generator().manual_seed(0)
    rows = torch.randperm(n, generator=gen)[:m].sort().values
    grad = torch.sparse_coo_tensor(
        rows[None], torch.randn(m, w, generator=gen), (n, w), check_invariants=False
    )
    grad = grad.coalesce()
    stream = SparseStream.from_torch_sparse(grad)
    print(f"COO ({n:,}, {w}), one sparse dimension, {m:,} rows; load {os.getloadavg()}")
    for name, fn in (
        ("SparseStream.from_torch_sparse", lambda: SparseStream.from_torch_sparse(grad)),
        ("SparseStream.to_torch_sparse", lambda: stream.to_torch_sparse((n, w), 1)),
    ):
        med, low = _time(fn, args.calls)
        print(f"{name:32s} median {med:8.1f} us  min {low:8.1f} us")


if __name__ == "__main__":
    main()
