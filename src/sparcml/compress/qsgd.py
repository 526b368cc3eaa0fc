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

import math

import torch

from ..errors import WireFormatError
from ..finite import all_finite
from ._kernels import chunks, exact_bernoulli, scratch
from .base import FLOAT32_MAX, Quantizer, check_finite, make_header, read_header, register
from .packing import pack_bits_into, packed_nbytes, unpack_bits

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

    def expected_nbytes(self, n: int) -> int:
        return 16 + 4 * (-(-n // self.bucket)) + packed_nbytes(n, self.bits)

    def quantize(
        self, values: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        n, b, s, bits = values.numel(), self.bucket, self.levels, self.bits
        v = values.to(torch.float32).contiguous()
        nb = -(-n // b)
        scales = torch.empty(nb, dtype=torch.float32, device=v.device)
        codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=v.device)
        gen = generator or self._generator(v.device)
        multiple = math.lcm(b, 8)
        for lo, hi in chunks(n, v.device, multiple):
            chunk = v[lo:hi]
            pad = (-(hi - lo)) % b
            if pad:
                chunk = torch.cat([chunk, torch.zeros(pad, dtype=chunk.dtype, device=v.device)])
            vb = chunk.view(-1, b)
            # Step 1: one scale per bucket
            scale = torch.linalg.vector_norm(vb, dim=1) if self.norm == "l2" else vb.abs().amax(1)
            # (buckets of very large or small values: one device sync finds them)
            rare = _out_of_range(vb, scale, self.norm == "l2")
            if rare is not None:
                scale = _wide_norms(vb, scale, rare, self.norm == "l2", s)
            scales[lo // b : lo // b + scale.numel()] = scale
            # Step 2: level = floor(s|v|/scale) + Bernoulli(fraction), unbiased
            # (s|v|/scale < 128, so s|v|/scale * 2^23 fits an int32: whole part and
            # 23-bit fraction in one conversion; intermediates in scratch buffers)
            inv = (s * float(1 << 23)) / torch.where(scale > 0, scale, torch.ones_like(scale))
            m = vb.numel()
            mag = scratch("qsgd_mag", m, torch.float32, v.device).view(vb.shape)
            torch.abs(vb, out=mag)
            mag *= inv.unsqueeze(1)
            if rare is not None:  # scale < s 2^23 / FLT_MAX: divide before scaling up
                mag[rare] = (vb[rare].abs() / scale[rare].unsqueeze(1)) * (s * float(1 << 23))
            fixed = scratch("qsgd_fixed", m, torch.int32, v.device).view(vb.shape)
            fixed.copy_(mag)
            frac = scratch("qsgd_frac", m, torch.int32, v.device).view(vb.shape)
            torch.bitwise_and(fixed, 0x7FFFFF, out=frac)
            level = exact_bernoulli(frac, 23, gen)
            fixed >>= 23
            level += fixed
            level.clamp_(max=s)
            # Step 3: sign and level codes, packed
            torch.bitwise_right_shift(vb.view(torch.int32), 31, out=frac)
            frac &= 1 << (bits - 1)
            level |= frac
            pack_bits_into(codes, level.view(-1)[: hi - lo], n, lo, bits)
        if self.check_finite and nb and not all_finite(scales):
            check_finite(v, "qsgd")
        return torch.cat(
            [make_header(1, n, flags=bits, device=v.device), scales.view(torch.uint8), codes]
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


#: a bucket's float32 scale is exact, and ``s 2^23 / scale`` finite, between these:
#: (1e-18)^2 and (1e18)^2 stay inside float32's normal range
_NORM_RANGE = (1e-18, 1e18)


def _out_of_range(vb: torch.Tensor, scale: torch.Tensor, l2: bool) -> torch.Tensor | None:
    """The rows whose scale lies outside :data:`_NORM_RANGE` (None: none)."""
    lo, hi = _NORM_RANGE
    # (on the nb scales alone: a zero scale is one more candidate, its values read
    # only where there are such buckets; one device sync)
    off = ~((scale >= lo) & (scale <= hi))  # zero, tiny, huge or NaN
    if not bool(off.any()):
        return None
    rows = off.nonzero().squeeze(1)
    if l2:  # a zero l2 scale is wrong only where its squares fell below the subnormals
        zero = scale[rows] == 0
        keep = ~zero | (vb[rows] != 0).any(1)
        rows = rows[keep]
    else:
        rows = rows[scale[rows] != 0]  # (a zero max is exact: all zeros)
    return rows if rows.numel() else None


def _wide_norms(
    vb: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, l2: bool, s: int
) -> torch.Tensor:
    """``scale`` with the l2 norms of ``rows`` computed again in float64: a bucket of
    values near 1e19 had an infinite float32 norm (decoded as NaN), one near 1e-23 a
    zero norm (decoded as zeros). A scale above ``FLT_MAX / s`` is refused: the
    decoded levels ``level * scale`` would overflow."""
    scale = scale.clone()
    if l2:
        scale[rows] = torch.linalg.vector_norm(vb[rows], dim=1, dtype=torch.float64).to(
            torch.float32
        )
    big = scale[rows]
    if bool((torch.isfinite(big) & (big > FLOAT32_MAX / s)).any()) or (
        bool(torch.isinf(big).any()) and bool(torch.isfinite(vb[rows]).all())
    ):
        raise ValueError(
            f"qsgd: a bucket's scale exceeds float32's largest value / {s} levels: "
            "values this large cannot be quantized"
        )
    return scale
