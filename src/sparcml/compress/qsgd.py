"""QSGD: stochastic quantization in buckets (paper 000, sec. 6; Alistarh et al. 2017).

Steps, for every bucket ``v`` of ``B`` consecutive values (default 1024):

1. Scale ``||v||`` (2-norm by default, or max-norm), sent as one float32.
2. ``s = 2^(bits-1) - 1`` levels; ``l_i = floor(s |v_i| / ||v|| + u_i)`` with
   ``u_i ~ U[0, 1)``: an unbiased stochastic rounding, ``E[l_i] = s |v_i| / ||v||``.
3. Code ``sign_i << (bits-1) | l_i``, ``bits`` in {2, 4, 8}, packed (4, 2 or 1 per byte).

Decoding gives ``sign_i * ||v|| * l_i / s``. Unbiased; variance (QSGD Lemma 3.1,
2-norm) ``E||Q(v) - v||^2 <= min(B/s^2, sqrt(B)/s) ||v||^2`` per bucket.

Payload: 16-byte header, ``ceil(n/B)`` float32 scales, ``ceil(n*bits/8)`` bytes
of codes.
"""

from __future__ import annotations

import torch

from ..errors import WireFormatError
from .base import Quantizer, check_finite, make_header, read_header, register
from .packing import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QSGD"]


@register("qsgd")
class QSGD(Quantizer):
    """Stochastic ``bits``-bit quantization with one full-precision scale per bucket.

    Args:
        bits: 2, 4 or 8 bits per value (sign included).
        bucket: values per bucket (>= 1).
        norm: ``"l2"`` (QSGD) or ``"max"``.
        seed: seed of this operator's random generator (None: nondeterministic).
        check_finite: refuse NaN/Inf input (otherwise they poison their bucket).
    """

    def __init__(
        self,
        bits: int = 4,
        bucket: int = 1024,
        norm: str = "l2",
        seed: int | None = 0,
        check_finite: bool = True,
    ) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"qsgd: bits must be 2, 4 or 8, got {bits}")
        if bucket < 1:
            raise ValueError(f"qsgd: bucket size must be at least 1, got {bucket}")
        if norm not in ("l2", "max"):
            raise ValueError(f"qsgd: norm must be 'l2' or 'max', got {norm!r}")
        self.bits, self.bucket, self.norm, self.seed = bits, bucket, norm, seed
        self.check_finite = check_finite
        self.levels = (1 << (bits - 1)) - 1
        self._gen: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = self._gen.get(device)
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._gen[device] = g
        return g

    def expected_nbytes(self, n: int) -> int:
        return 16 + 4 * (-(-n // self.bucket)) + packed_nbytes(n, self.bits)

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        if self.check_finite:
            check_finite(values, "qsgd")
        n, b, s = values.numel(), self.bucket, self.levels
        v = values.float()
        pad = (-n) % b
        if pad:
            v = torch.cat([v, torch.zeros(pad, dtype=v.dtype, device=v.device)])
        v = v.reshape(-1, b)
        # Step 1: one scale per bucket
        scale = v.norm(dim=1) if self.norm == "l2" else v.abs().amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        # Step 2: stochastic rounding to s levels
        u = torch.rand(v.shape, generator=self._generator(v.device), device=v.device)
        level = torch.floor(v.abs() / safe.unsqueeze(1) * s + u).clamp_(max=s)
        # Step 3: sign and level codes, packed
        codes = (level.to(torch.int32) | ((v < 0).to(torch.int32) << (self.bits - 1))).reshape(-1)
        return torch.cat(
            [
                make_header(1, n, flags=self.bits, device=v.device),
                scale.view(torch.uint8),
                pack_bits(codes[:n], self.bits),
            ]
        )

    def dequantize(
        self, payload: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        n, bits, body = read_header(payload, 1, "qsgd")
        if bits != self.bits:
            raise WireFormatError(f"qsgd: payload has {bits}-bit codes, operator uses {self.bits}")
        nb = -(-n // self.bucket)
        if body.numel() != 4 * nb + packed_nbytes(n, bits):
            raise WireFormatError(f"qsgd: payload of {body.numel()} bytes for {n} values")
        body = body.to(device)
        scale = body[: 4 * nb].clone().view(torch.float32)
        codes = unpack_bits(body[4 * nb :], n, bits)
        level = (codes & self.levels).float()
        sign = 1.0 - 2.0 * ((codes >> (bits - 1)) & 1).float()
        per_value = scale.repeat_interleave(self.bucket)[:n]
        return (sign * level * per_value / self.levels).to(dtype)
