"""Gaussian-k: a threshold from a Gaussian fit of the values (Shi et al., 2019).

Steps:

1. Fit ``N(mu, sigma^2)`` to the values (mean and standard deviation).
2. ``t = sigma * Phi^-1(1 - d/2)`` with ``d = k/n``: under the fit, a share ``d``
   of the entries has ``|x - mu| > t``.
3. Correct the fit: up to ``corrections`` times, scale ``t`` (by 1.1 or 1/1.1)
   while the count lies outside ``[k/2, 3k/2]``.
4. Select ``|x - mu| > t`` (NaN entries always).

Cheap (two reductions and a few counts), approximate: about ``k`` entries.

Beyond the paper: ``k >= n`` keeps every entry (``d = 1`` gives ``t = 0``, and a
constant vector has no ``|x - mu| > 0``), and a selection of fewer than ``k/2``
entries after the corrections (a constant or strongly skewed vector, whose
values the Gaussian does not fit) is replaced by the exact ``k`` farthest from the
mean (still a threshold set on ``|x - mu|``), or, where fewer than ``k/2`` entries
differ from the mean (a constant vector, a few outliers), the ``k`` largest
magnitudes: a non-zero accumulator under error feedback always sends at least
``min(k/2, its non-zeros)`` entries.
"""

from __future__ import annotations

import math

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import KSpec, count_above, select_above
from .topk import TopK

__all__ = ["GaussianK"]


@register("gaussiank")
class GaussianK(Selector):
    """About ``k`` entries beyond a Gaussian-fit threshold."""

    def __init__(
        self, k: int | None = None, density: float | None = None, corrections: int = 4
    ) -> None:
        self.spec = KSpec(k, density, "gaussiank")
        if corrections < 0:
            raise ValueError(f"gaussiank: corrections must be >= 0, got {corrections}")
        self.k, self.density, self.corrections = k, density, corrections

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        n = x.numel()
        k = self.spec.of(n)
        if k == 0:
            return SparseStream.empty(n, x.dtype, x.device)
        if k >= n:
            idx = torch.arange(n, device=x.device)
            return SparseStream.from_sorted(idx, x[idx], n)
        # Step 1: fit N(mu, sigma^2) (float64 accumulation, no float64 copy of x)
        sigma_t, mu_t = torch.std_mean(x, correction=1 if n > 1 else 0)
        mu, sigma = float(mu_t), float(sigma_t)
        if not (math.isfinite(mu) and math.isfinite(sigma)):  # NaN/Inf present: fit the rest
            finite = x[torch.isfinite(x)]
            mu = float(finite.double().mean()) if finite.numel() else 0.0
            sigma = float(finite.double().std()) if finite.numel() > 1 else 0.0
        # Step 2: the two-sided Gaussian quantile for a share d = k/n
        d = min(k / n, 1.0)
        z = math.sqrt(2.0) * float(torch.erfinv(torch.tensor(1.0 - d, dtype=torch.float64)))
        t = sigma * z
        centred = x - mu if mu != 0.0 else x
        # Step 3: correct the fit while the count is far from k
        for _ in range(self.corrections):
            count = count_above(centred, t)
            if count > 1.5 * k:
                t *= 1.1
            elif count < 0.5 * k and t > 0:
                t /= 1.1
            else:
                break
        # Step 4: select (NaN always)
        idx = select_above(centred, t)
        if idx.numel() < 0.5 * k:  # the fit failed: the k farthest from the mean
            idx = TopK(k=k).select(centred).indices
            if idx.numel() < 0.5 * k:  # most entries at the mean: the k largest
                idx = TopK(k=k).select(x).indices
        return SparseStream.from_sorted(idx, x[idx], n)
