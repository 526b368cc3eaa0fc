"""Threshold binary search selection (RedSync, paper 002, sec. 2.1, Alg. 3).

Steps:

1. ``l = 0``, ``r = max |x|``.
2. ``t = (l + r) / 2``; count ``|x| > t``: fewer than ``k`` -> ``r = t``; more than
   ``2k`` -> ``l = t``; otherwise stop and select ``|x| > t``.
3. Stop as well when ``r - l <= eps * r`` (``eps`` relative, default 1e-3).
4. Stopped on ``eps``: the entries between ``l`` and ``r`` are (nearly) tied, and
   ``|x| > l`` would select more than ``2k``. Select every ``|x| > r`` (fewer
   than ``k``) and fill up to exactly ``k`` with the entries in ``(l, r]`` in
   index order.

Count band (RedSync's own criterion, for any input distribution): between ``k``
and ``2k`` entries, the exact top-k among them; exactly ``k`` when ties stop the
search; every non-zero entry when there are at most ``2k`` (zeros are never
selected: they carry nothing). NaN counts as the largest magnitude.

Beyond the paper: Alg. 3 stops when ``r - l < eps`` with ``eps`` absolute. A
tolerance scaled by the largest magnitude (``eps * max|x|``) lets one outlier
stop the search on ``l = 0``, which then selects *everything* (the case is in
docs/compression.md). The tolerance here is relative to the current right
border, so the search keeps halving towards the bulk of the values, and step 4
replaces "select ``|x| > l``", so ties cannot inflate the selection.

*Sampled* variant (``interval > 1``, RedSync recommends 5): the threshold found
by a search is reused for the next ``interval - 1`` calls. Beyond the paper: a
reused threshold whose count leaves ``[k, 2k]`` (the gradient drifted) triggers
a new search at once, so the band holds on every call.
"""

from __future__ import annotations

import math

import torch

from .base import register
from .selection import ReusedThreshold, max_magnitude, select_above

__all__ = ["SampledThresholdBinarySearch", "ThresholdBinarySearch", "bsearch_threshold"]


def _fill_ties(
    x: torch.Tensor, cand_idx: torch.Tensor, cand_mag: torch.Tensor, hi: float, k: int
) -> torch.Tensor:
    """Step 4: every candidate above ``hi``, then the first candidates at or below it, k in all."""
    above = ~(cand_mag <= hi)  # NaN counts as above
    need = k - int(above.sum())
    if need > 0:
        tied = (~above).nonzero().flatten()[:need]
        above[tied] = True
    return cand_idx[above]


def bsearch_threshold(
    x: torch.Tensor, k: int, eps: float, max_steps: int = 64
) -> tuple[float, torch.Tensor]:
    """Alg. 3: a threshold ``t`` and the sorted positions it selects (see the module doc).

    Returns ``t`` and the selected positions: ``k <= count <= 2k`` (exactly ``k``
    on ties; all non-zeros when there are at most ``2k``). The thresholds and
    counts are Alg. 3's; once a step has raised the left border ``l``, only the
    entries above ``l`` can matter, so they are kept aside and later counts (and
    the final selection) look at them alone.
    """
    top = max_magnitude(x)
    has_nan = top != top
    if not math.isfinite(top):  # NaN or Inf present: search among the finite magnitudes
        finite = x[torch.isfinite(x)]
        top = max_magnitude(finite) if finite.numel() else 0.0
    lo, hi = 0.0, top
    cand_idx: torch.Tensor | None = None  # positions above lo, once narrowed
    cand_mag = torch.empty(0)
    checked_nonzeros = False
    for _ in range(max_steps):
        if hi - lo <= eps * hi:
            if cand_idx is not None:
                return lo, _fill_ties(x, cand_idx, cand_mag, hi, k)
            if checked_nonzeros:
                break
            # Still on l = 0 after the interval shrank below eps: maybe fewer than
            # 2k non-zeros exist at all (a mostly-zero gradient); then send them all.
            checked_nonzeros = True
            nonzero = select_above(x, 0.0, nan=has_nan)
            if nonzero.numel() <= 2 * k:
                return 0.0, nonzero
            cand_idx, cand_mag = nonzero, x[nonzero].abs()
            continue
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
    if cand_idx is None:  # only zeros (or nothing finite) above lo = 0
        return lo, select_above(x, lo, nan=has_nan)
    return lo, _fill_ties(x, cand_idx, cand_mag, hi, k)


@register("threshold_bsearch")
class ThresholdBinarySearch(ReusedThreshold):
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
        super().__init__(k, density, interval)
        if not 0 < eps < 1:
            raise ValueError(f"{self.name}: eps must lie in (0, 1), got {eps}")
        self.eps = eps
        self.searches = 0

    def find(self, x: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
        self.searches += 1
        return bsearch_threshold(x, k, self.eps)

    def reuse(self, x: torch.Tensor, k: int, threshold: float) -> torch.Tensor | None:
        idx = select_above(x, threshold)
        return idx if k <= idx.numel() <= 2 * k else None  # else: drifted, search now


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
