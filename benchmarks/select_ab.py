r"""The ``topk`` selection as a training step runs it, this checkout against another,
in one process.

Issue 30's lean step: ``sparcml.torch``'s sparse method selects the top-k of a
bucket's accumulator and, under the default ``nan_policy="propagate"``, must know
whether the accumulator holds NaN or +-inf. For each size and density, uniform
random normal entries (the papers' setting), the median time on one thread of

* the library of ``--before`` (another checkout's ``src`` folder):
  ``TopK.select_covering`` then ``all_finite`` of the accumulator, as its
  ``run_sparse`` did for a selection that does not hold every non-zero;
* this checkout: ``TopK.select_checked`` (``all_finite`` only where it cannot
  tell), as ``run_sparse`` does now,

alternated round by round (a shared host drifts between separate jobs by more
than the difference), with both selections checked equal.

    git worktree add /tmp/before 2f5c076
    .venv/bin/python benchmarks/select_ab.py --before /tmp/before/src \
        -N 262144,1323280,16M -d 0.01,0.001
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch
from codec_ab import ratio_text, start_ab  # this folder, on sys.path when run as a script

from sparcml.tools.cli.common import size_arg


def _before(lib: ModuleType, d: float) -> Callable[[torch.Tensor], object]:
    topk = importlib.import_module(lib.__name__ + ".compress.topk")
    finite = importlib.import_module(lib.__name__ + ".finite")
    sel = topk.TopK(density=d)

    def run(x: torch.Tensor) -> object:
        selected, covering = sel.select_covering(x)
        return selected, finite.all_finite(selected.values if covering else x)

    return run


def _after(d: float) -> Callable[[torch.Tensor], object]:
    from sparcml.compress.topk import TopK
    from sparcml.finite import all_finite

    sel = TopK(density=d)

    def run(x: torch.Tensor) -> object:
        selected, covering, ok = sel.select_checked(x)
        if ok is None:
            ok = all_finite(selected.values if covering else x)
        return selected, ok

    return run


def _seconds(fn: Callable[[torch.Tensor], object], x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="another checkout's src folder")
    ap.add_argument("-N", "--sizes", default="262144,1323280,16M")
    ap.add_argument("-d", "--densities", default="0.01,0.001")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=11, help="timed calls a round (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    before, load = start_ab(args.before)
    print(f"topk selection and its NaN/Inf check on one thread, float32, uniform normal "
          f"entries; {args.rounds} rounds of {args.calls} calls, libraries alternated; "
          f"load average {load}")  # fmt: skip
    print(f"{'N':>10} {'density':>8} {'before ms':>10} {'after ms':>9}  before/after per round")
    g = torch.Generator().manual_seed(args.seed)
    for n in (size_arg(s) for s in args.sizes.split(",")):
        x = torch.randn(n, generator=g)
        for d in (float(s) for s in args.densities.split(",")):
            old, new = _before(before, d), _after(d)
            (s1, f1), (s2, f2) = old(x), new(x)  # type: ignore[misc]
            if not (torch.equal(s1.indices, s2.indices) and torch.equal(s1.values, s2.values)):
                raise SystemExit(f"N={n} d={d}: the two selections differ")
            if f1 != f2:
                raise SystemExit(f"N={n} d={d}: the two NaN/Inf checks differ")
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.rounds):
                a.append(_seconds(old, x, args.calls) * 1e3)
                b.append(_seconds(new, x, args.calls) * 1e3)
            print(f"{n:>10} {d:>8g} {statistics.median(a):>10.3f} "
                  f"{statistics.median(b):>9.3f}  {ratio_text(a, b)}")  # fmt: skip
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
