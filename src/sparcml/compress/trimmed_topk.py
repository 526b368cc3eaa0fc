"""Trimmed top-k selection (RedSync, paper 002, sec. 2.1, Alg. 2).

Steps:

1. ``mean`` and ``max`` of ``|x|`` (one reduction each).
2. Threshold ``t = mean + r (max - mean)`` with ``r = 0.8``; while fewer than
   ``k`` entries exceed ``t``, lower ``r`` (0.8, 0.6, 0.4, 0.2, 0), then halve
   ``t`` below the mean, down to 0.
3. Trim: keep the entries with ``|x| > t`` (stream compaction).
4. Exact top-k among the survivors.

The result equals the exact top-k (the survivors contain it), at the cost of a
top-k over a much smaller set when the magnitudes are roughly normal.
"""

from __future__ import annotations

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import KSpec, magnitude, stream_of

__all__ = ["TrimmedTopK"]

_RATIOS = (0.8, 0.6, 0.4, 0.2, 0.0)


@register("trimmed_topk")
class TrimmedTopK(Selector):
    """Exact top-k found by trimming with a mean/max threshold first (RedSync Alg. 2)."""

    def __init__(self, k: int | None = None, density: float | None = None) -> None:
        self.spec = KSpec(k, density, "trimmed_topk")
        self.k, self.density = k, density

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        if k == 0:
            return SparseStream.empty(x.numel(), x.dtype, x.device)
        mag = magnitude(x)
        # Step 1
        mean, top = float(mag.float().mean()), float(mag.max())
        if top == float("inf"):
            mean = (
                float(mag[torch.isfinite(mag)].float().mean())
                if bool(torch.isfinite(mag).any())
                else 0.0
            )
        # Step 2: lower the threshold until at least k entries pass it
        survivors = None
        for r in _RATIOS:
            t = mean + r * (min(top, 3.4e38) - mean)
            cand = (mag > t).nonzero().flatten()
            if cand.numel() >= k:
                survivors = cand
                break
        t = mean
        while survivors is None:
            t = t / 2 if t > 1e-30 else 0.0
            cand = (
                (mag > t).nonzero().flatten() if t > 0 else torch.arange(x.numel(), device=x.device)
            )
            if cand.numel() >= k:
                survivors = cand
        # Steps 3-4: exact top-k among the survivors
        best = torch.topk(mag[survivors], k, sorted=False).indices
        return stream_of(x, survivors[best])
