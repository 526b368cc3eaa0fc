"""Shared pieces of the selectors: the k/density argument and NaN-safe magnitudes."""

from __future__ import annotations

import math

import torch

from ..stream import SparseStream

__all__ = ["KSpec", "magnitude", "stream_of"]


class KSpec:
    """``k`` (entries) or ``density`` (fraction of entries), exactly one of them.

    * ``k = 0`` selects nothing; ``k > n`` raises (a silent clamp would hide a
      mis-sized layer).
    * ``density`` in (0, 1] selects ``max(1, round(density * n))`` entries of a
      non-empty tensor.
    """

    def __init__(self, k: int | None, density: float | None, what: str) -> None:
        if (k is None) == (density is None):
            raise ValueError(f"{what}: give exactly one of k and density")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise ValueError(f"{what}: k must be a non-negative integer, got {k!r}")
        if density is not None and not (0.0 < density <= 1.0 and math.isfinite(density)):
            raise ValueError(f"{what}: density must lie in (0, 1], got {density!r}")
        self.k = k
        self.density = density
        self.what = what

    def of(self, n: int) -> int:
        if self.k is not None:
            if self.k > n:
                raise ValueError(f"{self.what}: k={self.k} exceeds the tensor's {n} entries")
            return self.k
        assert self.density is not None
        return 0 if n == 0 else min(n, max(1, round(self.density * n)))


def magnitude(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN mapped to +inf: NaN entries are selected first, never dropped."""
    return torch.nan_to_num(x.abs(), nan=float("inf"))


def stream_of(x: torch.Tensor, idx: torch.Tensor) -> SparseStream:
    """The entries ``idx`` (any order, unique) of the flat tensor ``x``."""
    idx = torch.sort(idx).values
    return SparseStream._trusted(idx, x[idx], x.numel())
