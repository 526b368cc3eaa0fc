"""Random-k: ``k`` entries drawn uniformly without replacement, seeded so ranks can agree."""

from __future__ import annotations

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import KSpec, stream_of

__all__ = ["RandomK", "uniform_subset"]


@register("randomk")
class RandomK(Selector):
    """``k`` uniformly random entries; call ``t`` of an instance uses seed ``(seed, t)``.

    Ranks that build the operator with the same ``seed`` and call it in step pick
    the same indices (then the sparse sum does not fill in).

    Args:
        k / density: how many entries (exactly one).
        seed: base seed shared by the ranks that must agree.
        scale: multiply the kept values by ``n/k`` (the unbiased random-k); off by
            default, the usual choice with error feedback.
    """

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        seed: int = 0,
        scale: bool = False,
    ) -> None:
        self.spec = KSpec(k, density, "randomk")
        self.k, self.density, self.seed, self.scale = k, density, seed, scale
        self.calls = 0

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        n = x.numel()
        k = self.spec.of(n)
        g = torch.Generator(device="cpu").manual_seed(hash((self.seed, self.calls)) & (2**63 - 1))
        self.calls += 1
        idx = uniform_subset(n, k, g).to(x.device)
        s = stream_of(x, idx)
        if self.scale and k:
            return SparseStream.from_sorted(s.indices, s.values * (n / k), n)
        return s


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions of ``range(n)``, every ``k``-subset equally likely, in
    O(k) time and memory for ``k <= n/2`` (a ``randperm(n)`` otherwise).

    Uniform draws with replacement until ``k`` distinct values are in, then ``k``
    of those at random: the set of distinct values drawn is invariant under any
    permutation of ``range(n)``, so given its size it is a uniform subset, and a
    uniform ``k``-subset of it is a uniform ``k``-subset of ``range(n)``. (A
    ``randperm(n)`` per call cost O(n): 128 MB and a shuffle for a 16M bucket.)
    """
    if 2 * k > n:
        return torch.randperm(n, generator=generator)[:k]
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < k:
        need = k - picked.numel()
        draws = torch.randint(n, (need + need // 8 + 16,), generator=generator)
        picked = torch.cat([picked, draws]).unique()
    if picked.numel() > k:
        picked = picked[torch.randperm(picked.numel(), generator=generator)[:k]]
    return picked
