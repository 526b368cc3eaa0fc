"""Exact top-k by magnitude (paper 000 sec. 2.2, "Top-k SGD")."""

from __future__ import annotations

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import KSpec, magnitude, stream_of

__all__ = ["TopK"]


@register("topk")
class TopK(Selector):
    """The ``k`` entries of largest magnitude (``torch.topk``; NaN counts as largest).

    Args:
        k: number of entries, or
        density: fraction of entries (exactly one of the two).

    Example:
        >>> TopK(k=2).select(torch.tensor([0.1, -3.0, 2.0, 0.5])).indices.tolist()
        [1, 2]
    """

    def __init__(self, k: int | None = None, density: float | None = None) -> None:
        self.spec = KSpec(k, density, "topk")
        self.k, self.density = k, density

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        idx = torch.topk(magnitude(x), k, sorted=False).indices
        return stream_of(x, idx)
