"""Alternating-sign quantization (RedSync, paper 002, sec. 2.2).

Even calls select the ``k`` largest *positive* values, odd calls the ``k`` most
negative ones; every selected value is replaced by the mean of the selection.
The message carries the indices and one float: all values share the mean's
sign, so no sign travels. (If fewer than ``k`` values have the wanted sign, all
of those are taken.)

Selection: RedSync implements ASQ "by slightly modifying our parallel-friendly
top-0.1% approaches" (sec. 2.2) and runs RGC+ASQ with trimmed top-k on
convolutional layers and threshold binary search on large layers (sec. 4), never
the sampled search ("sampled threshold binary search cannot be used with
quantization"). ``selector`` picks one of ``"topk"`` (exact),
``"trimmed_topk"`` or ``"threshold_bsearch"``; it runs on the magnitudes of the
wanted sign only (the other sign counts as zero and is never selected).

Payload: 16-byte header (``flags`` = the parity of the call), the mean as
float32, the number of indices (uint64), then the indices with ``c`` bytes each.
"""

from __future__ import annotations

import torch

from ..errors import WireFormatError
from ..reinterpret import as_bytes, bytes_as, index_low_bytes, indices_from_low_bytes
from ..stream import SparseStream, index_bytes
from .base import Compressor, Context, check_input, get, make_header, read_header, register
from .selection import KSpec

__all__ = ["ASQ"]


@register("asq")
class ASQ(Compressor):
    """Top-k of one sign per call, alternating, sent as indices plus their mean.

    Args:
        k / density: how many entries per call (exactly one).
        selector: ``"topk"``, ``"trimmed_topk"`` or ``"threshold_bsearch"``
            (RedSync's selectors; see the module docstring).
    """

    code = 8
    SELECTORS = ("topk", "trimmed_topk", "threshold_bsearch")

    def __init__(
        self, k: int | None = None, density: float | None = None, selector: str = "topk"
    ) -> None:
        self.spec = KSpec(k, density, "asq")
        if selector not in self.SELECTORS:
            raise ValueError(
                f"asq: selector must be one of {', '.join(self.SELECTORS)}, got {selector!r}"
            )
        self.k, self.density, self.selector = k, density, selector
        self._select = get(selector, k=k, density=density) if selector != "topk" else None
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
        if k == 0 or avail == 0:
            return SparseStream.empty(n, x.dtype, x.device)
        if self._select is None or avail <= k:  # (all of the wanted sign: no selector needed)
            k = min(k, avail)
            idx = torch.sort(torch.topk(signed, k, sorted=False).indices).values
        else:  # RedSync's selector on the wanted sign's magnitudes
            idx = self._select.select(signed.clamp(min=0)).indices
        mean = x[idx].double().mean().to(x.dtype)
        return SparseStream.from_sorted(idx, mean.expand(idx.numel()).clone(), n)

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
