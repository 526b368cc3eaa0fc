r"""The scans of ``sparcml.nonzero`` and ``sparcml.finite`` against torch's own ops.

Where a vector's values are not zero and whether they are finite, on one core,
the compiled CPU passes of the library (on the values' bit patterns) next to the
torch operations they replace, per size (p50 of ``--repeats`` after one untimed
call, the two alternated call by call's block so both see the same machine):

* ``drop_zeros``: the pairs of a stream without the ones whose value is zero (two
  zeros among ``k`` pairs, as the sum of two ranks' natural-compressed values
  holds at ``topk+natural``'s every step), against ``values == 0``, ``any`` and two
  boolean masks;
* ``nonzero_positions``: a dense vector's non-zero positions at density ``-d``
  (``SparseStream.from_dense``), against ``count_nonzero`` and ``nonzero``;
* ``all_finite``: one compiled reduction, against ``aminmax``, ``isfinite`` and
  ``all``.

    .venv/bin/python benchmarks/nonzero_scan.py --sizes 8770,65536,1M -d 0.005
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from sparcml.finite import all_finite
from sparcml.nonzero import count_nonzero, drop_zeros, nonzero_positions
from sparcml.tools.cli.common import size_arg


def _torch_drop(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    zero = values == 0
    if not bool(zero.any()):
        return indices, values
    keep = ~zero
    return indices[keep], values[keep]


def _torch_positions(x: torch.Tensor) -> torch.Tensor:
    int(torch.count_nonzero(x))
    return torch.nonzero(x).flatten()


def _torch_finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def _library_positions(x: torch.Tensor) -> torch.Tensor:
    return nonzero_positions(x, count_nonzero(x))


def p50_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """p50 microseconds of ``a`` and ``b``, alternated in blocks of 5 calls."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(max(1, repeats // 5)):
        for fn, out in ((a, ta), (b, tb)):
            for _ in range(5):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
    return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8770,65536,1M", help="entries, comma-separated")
    ap.add_argument("-d", "--density", type=float, default=0.005, help="of the dense vectors")
    ap.add_argument("--repeats", type=int, default=201)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"one thread, p50 of {args.repeats} calls each, alternated; load average {load}")
    print(f"{'scan':<18} {'entries':>10} {'torch us':>10} {'sparcml us':>11} {'ratio':>7}")
    g = torch.Generator().manual_seed(0)
    for n in (size_arg(s) for s in args.sizes.split(",")):
        values = torch.randn(n, generator=g)
        values[torch.randint(0, n, (2,), generator=g)] = 0.0
        indices = torch.randperm(8 * n, generator=g)[:n].sort().values
        dense = torch.zeros(n)
        nnz = max(1, int(n * args.density))
        dense[torch.randperm(n, generator=g)[:nnz]] = torch.randn(nnz, generator=g)
        finite = torch.randn(n, generator=g)
        rows = (
            ("drop_zeros", _torch_drop, drop_zeros, (indices, values)),
            ("nonzero_positions", _torch_positions, _library_positions, (dense,)),
            ("all_finite", _torch_finite, all_finite, (finite,)),
        )
        for name, old, new, inputs in rows:
            t_old, t_new = p50_pair(
                functools.partial(old, *inputs), functools.partial(new, *inputs), args.repeats
            )
            print(f"{name:<18} {n:>10,} {t_old:>10.1f} {t_new:>11.1f} {t_old / t_new:>6.2f}x")
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
