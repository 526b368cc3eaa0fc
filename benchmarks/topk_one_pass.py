"""The exact top-k selection on one CPU thread: one pass over the bit patterns
against the general path (issue 30, item 2: the lean step).

For each size and density, uniform random normal entries (the papers' setting),
the median time of

* ``one pass``: :func:`sparcml.compress.threshold_reuse.top_k_exact`, what
  ``TopK.select`` runs on large float32/float64 CPU tensors (a strided sample for
  the bracket's lower end, one compiled scan of ``|x| >= t_lo`` on the bit
  patterns, the k-th largest and the selection from those few);
* ``general``: :func:`~sparcml.compress.selection.magnitude` into a scratch
  buffer, :func:`~sparcml.compress.threshold_reuse.kth_largest` (its bracket
  pass) and :func:`~sparcml.compress.threshold_reuse.top_k_positions` (the
  positions pass): what it ran before, and still runs for other dtypes;
* ``torch.topk`` of the magnitudes, for reference,

the two exact paths checked equal (threshold and positions) on every input, and
the bytes of one read of the input over the one-pass time.

A second table, for sparse-feature gradients (``--nonzeros``: that many uniform
random positions non-zero, fewer than ``k``, as a hashed bag-of-words batch
leaves them), times the scan those take:

* ``one scan``: what ``top_k_exact`` runs when the sample's top reaches zeros:
  one scan for the non-zeros, which are the answer when fewer than ``k``;
* ``count + scan``: what it ran before: ``torch.count_nonzero``, then the scan;
* ``scan, int64 scalars``: the compiled scan given the mask and threshold as
  Python ints (compared as int64: every 32-bit word widened), as before, against
  ``scan``, the same kernel given scalars of the words' own type (as
  :func:`~sparcml.compress.selection.above_positions` gives them now).

    .venv/bin/python benchmarks/topk_one_pass.py -N 262144,1323280,16M -d 0.01,0.001
    .venv/bin/python benchmarks/topk_one_pass.py -N 1M,4M -d 0.01 --nonzeros 6000

Times depend on the machine: run it on a quiet one (the load average is printed).
"""

from __future__ import annotations

import argparse
import os

import torch

from sparcml.compress.selection import magnitude, scratch_magnitude, select_above
from sparcml.compress.threshold_reuse import kth_largest, top_k_exact, top_k_positions
from sparcml.kernels import compiled
from sparcml.tools.bench.local import median_seconds
from sparcml.tools.cli.common import size_arg


def _general(x: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    mag = scratch_magnitude(x)
    t = kth_largest(mag, k)
    return t, top_k_positions(mag, t, k)


def _count_and_scan(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The earlier path of a top-k reaching zeros: a count, then the scan."""
    if int(torch.count_nonzero(x)) >= k:
        return None
    return select_above(x, 0.0)


def _sparse_features(args: argparse.Namespace, g: torch.Generator) -> None:
    nnz = args.nonzeros
    print(f"\nfewer non-zeros than k: {nnz} uniform random positions non-zero (normal values)")
    print(
        f"{'N':>10} {'density':>8} {'k':>8} {'one scan ms':>12} {'count+scan ms':>14} "
        f"{'before/now':>11} {'scan ms':>8} {'int64 scalars ms':>17} {'int64/own':>10}"
    )
    kernel = compiled()
    for n in (size_arg(s) for s in args.sizes.split(",")):
        x = torch.zeros(n)
        x[torch.randperm(n, generator=g)[:nnz]] = torch.randn(nnz, generator=g)
        words = x.view(torch.int32).numpy()
        out = torch.empty(n, dtype=torch.int64).numpy()
        for d in (float(s) for s in args.densities.split(",")):
            k = max(1, round(d * n))
            if k <= nnz:
                raise SystemExit(f"--nonzeros {nnz} must be below k = {k} (N={n}, d={d})")
            t, pos = top_k_exact(x, k)
            before = _count_and_scan(x, k)
            if t != 0 or before is None or not torch.equal(pos, before):
                raise SystemExit(f"N={n} d={d}: the two paths differ")
            one = 1e3 * median_seconds(lambda: top_k_exact(x, k), args.repeats)  # noqa: B023
            old = 1e3 * median_seconds(lambda: _count_and_scan(x, k), args.repeats)  # noqa: B023
            # the kernel alone, |x| > 0: scalars of the words' type, or Python ints
            mask, tb = words.dtype.type(0x7FFF_FFFF), words.dtype.type(1)
            own = 1e3 * median_seconds(
                lambda: kernel.above_positions(words, mask, tb, 0, out),  # noqa: B023
                args.repeats,
            )
            wide = 1e3 * median_seconds(
                lambda: kernel.above_positions(words, 0x7FFF_FFFF, 1, 0, out),  # noqa: B023
                args.repeats,
            )
            print(
                f"{n:>10} {d:>8g} {k:>8} {one:>12.3f} {old:>14.3f} {old / one:>10.2f}x "
                f"{own:>8.3f} {wide:>17.3f} {wide / own:>9.2f}x"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--sizes", default="262144,1323280,16M")
    ap.add_argument("-d", "--densities", default="0.01,0.001")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--nonzeros",
        type=int,
        default=0,
        help="time inputs with this many non-zeros (fewer than k) instead",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    g = torch.Generator().manual_seed(args.seed)
    if args.nonzeros:
        print(f"exact top-k on one thread, float32; load average {load}")
        _sparse_features(args, g)
        return
    print(f"exact top-k on one thread, float32, uniform normal entries; load average {load}")
    print(
        f"{'N':>10} {'density':>8} {'k':>8} {'one pass ms':>12} {'general ms':>11} "
        f"{'torch.topk ms':>14} {'general/one':>12} {'GB/s read':>10}"
    )
    for n in (size_arg(s) for s in args.sizes.split(",")):
        x = torch.randn(n, generator=g)
        for d in (float(s) for s in args.densities.split(",")):
            k = max(1, round(d * n))
            t1, p1 = top_k_exact(x, k)
            t2, p2 = _general(x, k)
            if t1 != t2 or not torch.equal(p1, p2):
                raise SystemExit(f"N={n} d={d}: the two paths differ")
            one = 1e3 * median_seconds(lambda: top_k_exact(x, k), args.repeats)  # noqa: B023
            gen = 1e3 * median_seconds(lambda: _general(x, k), args.repeats)  # noqa: B023
            ref = 1e3 * median_seconds(
                lambda: torch.topk(magnitude(x), k, sorted=False),  # noqa: B023
                max(3, args.repeats // 4),
            )
            gbs = x.numel() * x.element_size() / (one * 1e-3) / 1e9
            print(
                f"{n:>10} {d:>8g} {k:>8} {one:>12.3f} {gen:>11.3f} {ref:>14.3f} "
                f"{gen / one:>11.2f}x {gbs:>10.1f}"
            )


if __name__ == "__main__":
    main()
