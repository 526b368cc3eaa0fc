"""Shared pieces of the selectors: the k/density argument and NaN-safe magnitudes."""

from __future__ import annotations

import math

import torch

from ..stream import SparseStream
from ._kernels import chunks

__all__ = ["KSpec", "count_above", "magnitude", "max_magnitude", "select_above", "stream_of"]


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


def max_magnitude(x: torch.Tensor) -> float:
    """``max |x|`` in one pass without a temporary (NaN if any entry is NaN)."""
    if x.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(x)
    return (
        max(-float(lo), float(hi)) if not (bool(lo.isnan()) or bool(hi.isnan())) else float("nan")
    )


def _above(chunk: torch.Tensor, t: float, strict: bool, nan: bool = True) -> torch.Tensor:
    if not nan:  # the caller knows there is no NaN: the plain comparison is one op less
        return chunk.abs() > t if strict else chunk.abs() >= t
    # NaN fails every comparison, so the negated test keeps it: NaN counts as +inf.
    return ~(chunk.abs() <= t) if strict else ~(chunk.abs() < t)


def count_above(x: torch.Tensor, t: float, strict: bool = True) -> int:
    """How many entries have ``|x| > t`` (``>=`` if not ``strict``); NaN counts. Chunked."""
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for lo, hi in chunks(x.numel(), x.device):
        total += _above(x[lo:hi], t, strict).sum()
    return int(total)


def select_above(x: torch.Tensor, t: float, strict: bool = True, nan: bool = True) -> torch.Tensor:
    """Sorted int64 positions with ``|x| > t`` (``>=`` if not ``strict``); NaN included.

    ``nan=False`` promises that ``x`` holds no NaN (a faster test).
    """
    parts = [
        _above(x[lo:hi], t, strict, nan).nonzero().flatten() + lo
        for lo, hi in chunks(x.numel(), x.device)
    ]
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]
