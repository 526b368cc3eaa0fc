"""Threshold binary search selection (RedSync, paper 002, sec. 2.1, Alg. 3).

Steps:

1. ``l = 0``, ``r = max |x|``.
2. ``t = (l + r) / 2``; count ``|x| > t``: fewer than ``k`` -> ``r = t``; more than
   ``2k`` -> ``l = t``; otherwise stop.
3. Stop as well when ``r - l < eps * max|x|`` (``eps`` relative, default 1e-3).
4. Select every entry with ``|x| > t`` (with ``t = l`` if the search stopped on
   ``eps``, so that at least ``k`` entries pass).

The selection contains the exact top-k and, unless ties or ``eps`` cut the
search short, between ``k`` and ``2k`` entries. No top-k (radix select) at all:
only reductions and one compaction.

*Sampled* variant (``interval > 1``, RedSync recommends 5): the threshold found
by a search is reused for the next ``interval - 1`` calls.
"""

from __future__ import annotations

import math

import torch

from ..stream import SparseStream
from ._selection import KSpec, max_magnitude, select_above
from .base import Selector, check_input, register

__all__ = ["SampledThresholdBinarySearch", "ThresholdBinarySearch", "bsearch_threshold"]


def bsearch_threshold(
    x: torch.Tensor, k: int, eps: float, max_steps: int = 64
) -> tuple[float, torch.Tensor]:
    """Alg. 3: a threshold ``t`` with ``k <= count(|x| > t) <= 2k`` where the data allows.

    Returns ``t`` and the sorted positions with ``|x| > t`` (NaN included). The
    thresholds and counts are exactly Alg. 3's; once a step has raised the left
    border ``l``, only the entries above ``l`` can matter, so they are kept aside
    and later counts (and the final selection) look at them alone.
    """
    top = max_magnitude(x)
    has_nan = top != top
    if not math.isfinite(top):  # NaN or Inf present: search among the finite magnitudes
        finite = x[torch.isfinite(x)]
        top = max_magnitude(finite) if finite.numel() else 0.0
    lo, hi = 0.0, top
    tol = eps * top
    cand_idx: torch.Tensor | None = None  # positions above lo, once narrowed
    cand_mag = torch.empty(0)
    for _ in range(max_steps):
        if hi - lo <= tol:
            break
        mid = 0.5 * (lo + hi)
        if cand_idx is None:
            above_idx = select_above(x, mid, nan=has_nan)
            count = above_idx.numel()
        else:
            keep = ~(cand_mag <= mid)
            count = int(keep.sum())
        if count < k:
            hi = mid
            continue
        if cand_idx is not None:
            above_idx, cand_mag = cand_idx[keep], cand_mag[keep]
        else:
            cand_mag = x[above_idx].abs()
        if count > 2 * k:
            lo, cand_idx = mid, above_idx
        else:
            return mid, above_idx
    return lo, cand_idx if cand_idx is not None else select_above(x, lo, nan=has_nan)


@register("threshold_bsearch")
class ThresholdBinarySearch(Selector):
    """Entries above a binary-searched threshold: at least the top-k, about k..2k of them.

    Args:
        k / density: target count (exactly one).
        eps: stop when the search interval is below ``eps * max|x|``.
        interval: search every ``interval`` calls, reuse the threshold in between
            (1 = always search; RedSync's sampled variant uses 5).
    """

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        eps: float = 1e-3,
        interval: int = 1,
    ) -> None:
        self.spec = KSpec(k, density, self.name or "threshold_bsearch")
        if not 0 < eps < 1:
            raise ValueError(f"{self.name}: eps must lie in (0, 1), got {eps}")
        if interval < 1:
            raise ValueError(f"{self.name}: interval must be at least 1, got {interval}")
        self.k, self.density, self.eps, self.interval = k, density, eps, interval
        self.calls = 0
        self.searches = 0
        self.threshold: float | None = None

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        if k == 0:
            return SparseStream.empty(x.numel(), x.dtype, x.device)
        if self.threshold is None or self.calls % self.interval == 0:
            self.threshold, idx = bsearch_threshold(x, k, self.eps)
            self.searches += 1
        else:
            idx = select_above(x, self.threshold)
        self.calls += 1
        return SparseStream._trusted(idx, x[idx], x.numel())


@register("sampled_threshold_bsearch")
class SampledThresholdBinarySearch(ThresholdBinarySearch):
    """:class:`ThresholdBinarySearch` searching every 5th call by default (RedSync)."""

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        eps: float = 1e-3,
        interval: int = 5,
    ) -> None:
        super().__init__(k, density, eps, interval)
