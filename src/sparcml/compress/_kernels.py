"""Cache-friendly building blocks of the quantizers.

Large tensors are processed in chunks of :data:`CHUNK` elements on the CPU, so
every intermediate stays in cache instead of streaming through memory once per
elementwise operation (a 5x difference on a 64 MB tensor). On CUDA one chunk
covers the whole tensor. The loop runs over chunks, never over elements.

Random numbers: ``exact_bernoulli(num, bits)`` draws ``True`` with probability
exactly ``num / 2^bits`` (the top ``bits`` of a uniform 31-bit draw compared with
``num``): unbiased to the last bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["CHUNK", "chunks", "exact_bernoulli"]

CHUNK = 1 << 18


def chunks(n: int, device: torch.device, multiple: int = 8) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` ranges covering ``[0, n)``; each but the last a multiple of ``multiple``."""
    if device.type != "cpu":
        yield 0, n
        return
    step = max(multiple, (CHUNK // multiple) * multiple)
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def exact_bernoulli(
    num: torch.Tensor, bits: int, generator: torch.Generator | None
) -> torch.Tensor:
    """int32 0/1 values, 1 with probability exactly ``num / 2^bits`` (``0 < bits <= 31``).

    One 31-bit uniform draw ``r`` per element, shifted down to ``bits`` bits; the
    result is the sign bit of ``r - num`` (1 iff ``r < num``), computed in place.
    """
    if not 0 < bits <= 31:
        raise ValueError(f"bits must lie in (0, 31], got {bits}")
    r = torch.empty(num.shape, dtype=torch.int32, device=num.device)
    r.random_(generator=generator)  # uniform in [0, 2^31)
    r >>= 31 - bits
    r -= num
    r >>= 31
    r &= 1
    return r
