"""Top-k by a reused threshold (Ok-Topk, paper 001: "threshold reuse").

The exact k-th largest magnitude is computed every ``interval`` calls (Ok-Topk's
tau'); the calls in between select ``|x| >= t`` with the stored ``t``, one
comparison pass instead of a top-k. Gradients change slowly between iterations,
so the count stays close to ``k``.
"""

from __future__ import annotations

import torch

from ..stream import SparseStream
from ._selection import KSpec, magnitude, select_above
from .base import Selector, check_input, register

__all__ = ["ThresholdReuse", "kth_largest"]


def kth_largest(mag: torch.Tensor, k: int) -> float:
    """The exact ``k``-th largest value of ``mag`` (``k >= 1``)."""
    return float(torch.topk(mag, k, sorted=False).values.min())


@register("threshold_reuse")
class ThresholdReuse(Selector):
    """``|x| >= t``, with ``t`` the exact k-th magnitude refreshed every ``interval`` calls.

    Args:
        k / density: target count (exactly one).
        interval: calls between exact recomputations (Ok-Topk's tau'; 1 = always exact).
    """

    def __init__(
        self, k: int | None = None, density: float | None = None, interval: int = 32
    ) -> None:
        self.spec = KSpec(k, density, "threshold_reuse")
        if interval < 1:
            raise ValueError(f"threshold_reuse: interval must be at least 1, got {interval}")
        self.k, self.density, self.interval = k, density, interval
        self.calls = 0
        self.refreshes = 0
        self.threshold: float | None = None

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        if k == 0:
            return SparseStream.empty(x.numel(), x.dtype, x.device)
        if self.threshold is None or self.calls % self.interval == 0:
            self.threshold = kth_largest(magnitude(x), k)
            self.refreshes += 1
        self.calls += 1
        idx = select_above(x, self.threshold, strict=False)
        return SparseStream._trusted(idx, x[idx], x.numel())
