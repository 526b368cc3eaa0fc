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

import torch

from ..stream import SparseStream
from ._selection import KSpec, magnitude
from .base import Selector, check_input, register

__all__ = ["SampledThresholdBinarySearch", "ThresholdBinarySearch", "bsearch_threshold"]


def bsearch_threshold(mag: torch.Tensor, k: int, eps: float, max_steps: int = 64) -> float:
    """A threshold ``t`` with ``k <= count(mag > t) <= 2k`` where the data allows (Alg. 3)."""
    top = float(mag.max())
    if top == float("inf"):
        finite = mag[torch.isfinite(mag)]
        top = float(finite.max()) if finite.numel() else 0.0
    lo, hi = 0.0, top
    tol = eps * top
    for _ in range(max_steps):
        if hi - lo <= tol:
            return lo
        mid = 0.5 * (lo + hi)
        count = int((mag > mid).sum())
        if count < k:
            hi = mid
        elif count > 2 * k:
            lo = mid
        else:
            return mid
    return lo


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
        mag = magnitude(x)
        if self.threshold is None or self.calls % self.interval == 0:
            self.threshold = bsearch_threshold(mag, k, self.eps)
            self.searches += 1
        self.calls += 1
        idx = (mag > self.threshold).nonzero().flatten()
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
