"""Block top-k: the top ``b`` of every block of ``B`` consecutive entries.

SparCML's production speech-recognition setting keeps 4 of every 512 (paper 000,
sec. 8.3): the selection is local to a block, so it parallelises and bounds the
nnz exactly at ``b * ceil(n / B)``.
"""

from __future__ import annotations

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import magnitude, stream_of

__all__ = ["BlockTopK"]


@register("blocktopk")
class BlockTopK(Selector):
    """Keep the ``per_block`` largest magnitudes of every ``block`` consecutive entries.

    The last block may be shorter; it keeps ``min(per_block, its length)``.
    """

    def __init__(self, per_block: int = 4, block: int = 512) -> None:
        if block < 1:
            raise ValueError(f"blocktopk: block size must be at least 1, got {block}")
        if not 0 <= per_block <= block:
            raise ValueError(f"blocktopk: per_block must lie in [0, {block}], got {per_block}")
        self.per_block, self.block = per_block, block

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        n, b, bs = x.numel(), self.per_block, self.block
        if n == 0 or b == 0:
            return SparseStream.empty(n, x.dtype, x.device)
        full = (n // bs) * bs
        parts = []
        if full:
            mag = magnitude(x[:full]).reshape(-1, bs)
            local = torch.topk(mag, b, dim=1, sorted=False).indices
            offsets = torch.arange(0, full, bs, device=x.device).unsqueeze(1)
            parts.append((local + offsets).reshape(-1))
        if full < n:
            tail = magnitude(x[full:])
            parts.append(torch.topk(tail, min(b, n - full), sorted=False).indices + full)
        return stream_of(x, torch.cat(parts))
