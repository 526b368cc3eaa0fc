r"""One ``topk`` step of a sparse gradient, its top-k taken from the entries of
``residual + g`` or from the densified bucket, by how full the residual is (issue
30, the lean step; ``sparcml.torch.reduce.ENTRIES_MAX`` is chosen from it).

One process (a one-rank communicator), one thread, a ``(--features, 1)`` bucket
at density 0.01; before every timed step the stored residual is reset to the same
``fill`` share of non-zeros, and the gradient holds ``--rows`` rows. Prints the
median of ``--steps`` steps either way, their ratio, and the load average.

    .venv/bin/python benchmarks/entries_fill.py --features 1M --rows 10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import sparcml.torch.reduce as red
from sparcml.comm import SelfCommunicator
from sparcml.torch import SparcmlState
from sparcml.torch.reduce import Bucket, reduce_sparse_gradient

FILLS = (0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.5)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _grad(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.randperm(n, generator=gen)[:m].sort().values
    vals = torch.randn(m, 1, generator=gen)
    return torch.sparse_coo_tensor(rows[None], vals, (n, 1), check_invariants=False).coalesce()


def _step_ms(n: int, rows: int, fill: float, steps: int, entries: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    state = SparcmlState("topk", comm=SelfCommunicator(), density=0.01)
    reduce_sparse_gradient(state, Bucket(("w",), (n,), _grad(n, 2 * rows, gen), 0))  # stores it
    saved = torch.zeros(n)  # (the residual is kept flat)
    where = torch.randperm(n, generator=gen)[: int(fill * n)]
    saved[where] = torch.randn(where.numel(), generator=gen) * 1e-3
    g = _grad(n, rows, gen)
    red.ENTRIES_MAX = 1.0 if entries else 0.0  # (0: every such step densifies)
    times = []
    for step in range(1, steps + 2):
        state.residuals["w"].copy_(saved)
        t = time.perf_counter()
        reduce_sparse_gradient(state, Bucket(("w",), (n,), g, step))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", type=_size, default=1 << 20)
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep = red.ENTRIES_MAX
    print(f"bucket ({args.features:,}, 1), {args.rows:,} rows a step; load {os.getloadavg()}")
    for fill in FILLS:
        ms = [_step_ms(args.features, args.rows, fill, args.steps, e) for e in (True, False)]
        print(
            f"residual {fill:5.2f} full ({int(fill * args.features):,} non-zeros): from the "
            f"entries {ms[0]:7.2f} ms, densified {ms[1]:7.2f} ms, ratio {ms[0] / ms[1]:.2f}"
        )
    red.ENTRIES_MAX = keep


if __name__ == "__main__":
    main()
