"""Alternating-sign quantization (RedSync, paper 002, sec. 2.2).

Even calls select the ``k`` largest *positive* values, odd calls the ``k`` most
negative ones; every selected value is replaced by the mean of the selection.
The message carries the indices and one float: all values share the mean's
sign, so no sign travels. (If fewer than ``k`` values have the wanted sign, all
of those are taken.)

Payload: 16-byte header (``flags`` = the parity of the call), the mean as
float32, the number of indices (uint64), then the indices with ``c`` bytes each.
"""

from __future__ import annotations

import torch

from ..errors import WireFormatError
from ..reinterpret import as_bytes, bytes_as, index_low_bytes, indices_from_low_bytes
from ..stream import SparseStream, index_bytes
from ._selection import KSpec
from .base import Compressor, Context, check_input, make_header, read_header, register

__all__ = ["ASQ"]


@register("asq")
class ASQ(Compressor):
    """Top-k of one sign per call, alternating, sent as indices plus their mean.

    Args:
        k / density: how many entries per call (exactly one).
    """

    code = 8

    def __init__(self, k: int | None = None, density: float | None = None) -> None:
        self.spec = KSpec(k, density, "asq")
        self.k, self.density = k, density
        self.calls = 0

    def select(self, tensor: torch.Tensor) -> SparseStream:
        """This call's selection with every value set to the selection's mean."""
        x = check_input(tensor, "asq")
        n = x.numel()
        k = self.spec.of(n)
        positive = self.calls % 2 == 0
        self.calls += 1
        signed = x if positive else -x
        signed = torch.nan_to_num(signed, nan=float("-inf"))
        avail = int((signed > 0).sum())
        k = min(k, avail)
        if k == 0:
            return SparseStream.empty(n, x.dtype, x.device)
        idx = torch.sort(torch.topk(signed, k, sorted=False).indices).values
        mean = x[idx].double().mean().to(x.dtype)
        return SparseStream._trusted(idx, mean.expand(k).clone(), n)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        ctx = Context.of(tensor)
        parity = self.calls % 2
        s = self.select(tensor)
        n = s.size
        mean = s.values[:1].float() if s.nnz else torch.zeros(1, device=s.device)
        c = index_bytes(n)
        idx = index_low_bytes(s.indices, c)
        count = as_bytes(torch.tensor([s.nnz], dtype=torch.int64)).to(s.device)
        return (
            torch.cat(
                [
                    make_header(self.code, n, flags=parity, device=s.device),
                    as_bytes(mean),
                    count,
                    idx,
                ]
            ),
            ctx,
        )

    def decompress(self, payload: torch.Tensor, ctx: Context) -> torch.Tensor:
        n, _, body = read_header(payload, self.code, "asq")
        if n != ctx.numel or body.numel() < 12:
            raise WireFormatError(f"asq: payload for {n} values, local tensor has {ctx.numel}")
        body = body.to(ctx.device)
        mean = bytes_as(body[:4], torch.float32)
        k = int(bytes_as(body[4:12].cpu(), torch.int64)[0])
        c = index_bytes(n)
        if k < 0 or body.numel() != 12 + k * c:
            raise WireFormatError(f"asq: malformed payload ({body.numel()} bytes, k={k})")
        idx = indices_from_low_bytes(body[12:], c)
        if k and (int(idx.max()) >= n or int(idx.min()) < 0):
            raise WireFormatError("asq: index out of range")
        out = torch.zeros(n, dtype=ctx.dtype, device=ctx.device)
        out[idx] = mean.to(ctx.dtype)
        return out.reshape(ctx.shape)

    @staticmethod
    def payload_size(n: int, k: int) -> int:
        """Bytes of a payload with ``k`` indices into ``n`` values."""
        return 16 + 4 + 8 + k * index_bytes(n)
