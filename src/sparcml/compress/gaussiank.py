"""Gaussian-k: a threshold from a Gaussian fit of the values (Shi et al., 2019).

Steps:

1. Fit ``N(mu, sigma^2)`` to the values (mean and standard deviation).
2. ``t = sigma * Phi^-1(1 - d/2)`` with ``d = k/n``: under the fit, a share ``d``
   of the entries has ``|x - mu| > t``.
3. Correct the fit: up to ``corrections`` times, scale ``t`` (by 1.1 or 1/1.1)
   while the count lies outside ``[k/2, 3k/2]``.
4. Select ``|x - mu| > t`` (NaN entries always).

Cheap (two reductions and a few counts), approximate: about ``k`` entries.
"""

from __future__ import annotations

import math

import torch

from ..stream import SparseStream
from ._selection import KSpec
from .base import Selector, check_input, register

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
        finite = torch.isfinite(x)
        xf = x[finite].double() if not bool(finite.all()) else x.double()
        mu = float(xf.mean()) if xf.numel() else 0.0
        sigma = float(xf.std()) if xf.numel() > 1 else 0.0
        dev = torch.nan_to_num((x.double() - mu).abs(), nan=float("inf"))
        d = min(k / n, 1.0)
        z = math.sqrt(2.0) * float(torch.erfinv(torch.tensor(1.0 - d, dtype=torch.float64)))
        t = sigma * z
        for _ in range(self.corrections):
            count = int((dev > t).sum())
            if count > 1.5 * k:
                t *= 1.1
            elif count < 0.5 * k and t > 0:
                t /= 1.1
            else:
                break
        idx = (dev > t).nonzero().flatten()
        return SparseStream._trusted(idx, x[idx], n)
