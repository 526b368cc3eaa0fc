"""General dithering: standard random dithering and natural dithering (paper 004, sec. 4).

``D(x) = ||x||_p * sign(x_i) * xi(|x_i| / ||x||_p)`` where ``xi`` rounds
``y in [l_j, l_(j+1)]`` up to ``l_(j+1)`` with probability
``(y - l_j) / (l_(j+1) - l_j)`` and down to ``l_j`` otherwise (unbiased). Levels:

* standard dithering: ``0, 1/s, 2/s, ..., 1`` (linear);
* natural dithering: ``0, 2^(1-s), 2^(2-s), ..., 1/2, 1`` (binary geometric).

Natural dithering has variance ``omega = 1/8 + d^(1/min(p,2)) 2^(1-s)
min(1, d^(1/min(p,2)) 2^(1-s))`` (Thm 4) and needs exponentially fewer levels
than standard dithering for the same variance (Thm 5).

Payload: 16-byte header; the norm as one float32, or naturally compressed to one
byte (``compress_norm=True``: sign/zero/6-bit exponent, unbiased); then per value
a code ``sign << L | level`` with ``L = ceil(log2(s+1))`` level bits, packed.
"""

from __future__ import annotations

import math

import torch

from ..errors import WireFormatError
from ._kernels import chunks, exact_bernoulli
from .base import FLOAT32_MAX, Quantizer, check_finite, make_header, read_header, register
from .natural import NaturalCompression
from .packing import pack_bits_into, packed_nbytes, unpack_bits

__all__ = ["Dithering", "NaturalDithering"]


class _GeneralDithering(Quantizer):
    natural_levels = False
    _code = 4

    def __init__(
        self,
        levels: int = 8,
        p: float = 2.0,
        compress_norm: bool = False,
        seed: int | None = 0,
        check_finite: bool = True,
    ) -> None:
        if not isinstance(levels, int) or not 1 <= levels <= 32:
            raise ValueError(f"{self.name}: levels s must be an integer in [1, 32], got {levels}")
        if not (p >= 1 or p == float("inf")):
            raise ValueError(f"{self.name}: p must be >= 1 or inf, got {p}")
        self.levels, self.p, self.compress_norm, self.seed = levels, p, compress_norm, seed
        self.check_finite = check_finite
        self.level_bits = max(1, math.ceil(math.log2(levels + 1)))
        self.bits = self.level_bits + 1
        self._norm_codec = NaturalCompression(format=8, e_min=-30, seed=seed)

    def level_values(self, device: torch.device) -> torch.Tensor:
        """The ``s + 1`` levels ``l_0 = 0 < l_1 < ... < l_s = 1`` (float64)."""
        s = self.levels
        j = torch.arange(s + 1, dtype=torch.float64, device=device)
        if self.natural_levels:
            lv = torch.pow(2.0, j - s)
            lv[0] = 0.0
            return lv
        return j / s

    def expected_nbytes(self, n: int) -> int:
        return 16 + (17 if self.compress_norm else 4) + packed_nbytes(n, self.bits)

    def _levels_of(self, y: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """Stochastic level indices of ``y`` in [0, 1] (int32), unbiased per Def. 3."""
        s = self.levels
        if self.natural_levels:
            # l_j = 2^(j-s) for j >= 1, l_0 = 0: j = floor(log2 y) + s, 0 below 2^(1-s)
            _, e = torch.frexp(y)  # y = m 2^e, m in [0.5, 1): floor(log2 y) = e - 1
            j = (e + (s - 1)).clamp_(min=0, max=s)
            j = torch.where(y < 2.0 ** (1 - s), torch.zeros_like(j), j)
            lo = torch.where(j > 0, torch.ldexp(torch.ones_like(y), (j - s).to(y.dtype)), 0.0)
            width = torch.where(j > 0, lo, torch.full_like(y, 2.0 ** (1 - s)))
            frac = (y - lo) / width
        else:
            t = y * s
            jf = t.floor()
            frac = t - jf
            j = jf.to(torch.int32)
        num = (frac * float(1 << 23)).to(torch.int32).clamp_(0, (1 << 23) - 1)
        up = exact_bernoulli(num, 23, gen)
        return (j + up).clamp_(max=s)

    def quantize(
        self, values: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        n = values.numel()
        x = values.to(torch.float32).contiguous()
        norm64 = (
            torch.linalg.vector_norm(x, ord=self.p, dtype=torch.float64)
            if n
            else torch.zeros((), dtype=torch.float64, device=x.device)
        )
        if self.check_finite and not bool(torch.isfinite(norm64)):
            check_finite(x, self.name)
        # the levels refer to the float32 norm that travels; a norm beyond float32's
        # range (finite values near its largest) is sent as that largest value: any
        # scale at least max|x| keeps E[D(x)] = x (Def. 3 needs y = |x| / scale <= 1)
        norm = norm64.clamp(max=FLOAT32_MAX).float()
        gen = generator or self._generator(x.device)
        if self.compress_norm:
            # C_nat of the norm is unbiased and independent of the levels: E[D(x)] = x
            # still. It draws from the same generator, so a generator passed per rank
            # (the collectives' own-contribution generator) decorrelates it too.
            norm_payload = self._norm_codec.quantize(norm.reshape(1), gen)
        else:
            norm_payload = norm.reshape(1).view(torch.uint8)
        inv = 1.0 / float(norm) if float(norm) > 0 else 0.0
        # (a norm below 1 / FLT_MAX: its inverse is infinite in float32, divide instead)
        divide = inv > FLOAT32_MAX
        out = torch.empty(packed_nbytes(n, self.bits), dtype=torch.uint8, device=x.device)
        for lo, hi in chunks(n, x.device):
            chunk = x[lo:hi]
            y = (chunk.abs() / norm if divide else chunk.abs() * inv).clamp_(max=1.0)
            level = self._levels_of(y, gen)
            sign = (chunk.view(torch.int32) >> 31) & (1 << self.level_bits)
            pack_bits_into(out, level | sign, n, lo, self.bits)
        return torch.cat(
            [
                make_header(self._code, n, flags=self.levels, device=x.device),
                norm_payload.to(x.device),
                out,
            ]
        )

    def dequantize(
        self, payload: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        n, levels, body = read_header(payload, self._code, self.name)
        if levels != self.levels:
            raise WireFormatError(
                f"{self.name}: payload has {levels} levels, operator {self.levels}"
            )
        norm_bytes = 17 if self.compress_norm else 4
        if body.numel() != norm_bytes + packed_nbytes(n, self.bits):
            raise WireFormatError(f"{self.name}: payload of {body.numel()} bytes for {n} values")
        body = body.to(device)
        if self.compress_norm:
            norm = self._norm_codec.dequantize(body[:norm_bytes], torch.float64, device)[0]
        else:
            norm = body[:4].clone().view(torch.float32)[0].double()
        codes = unpack_bits(body[norm_bytes:], n, self.bits)
        level = (codes & ((1 << self.level_bits) - 1)).long().clamp(max=self.levels)
        sign = 1.0 - 2.0 * ((codes >> self.level_bits) & 1).double()
        return (sign * norm * self.level_values(device)[level]).to(dtype)


@register("dithering")
class Dithering(_GeneralDithering):
    """Standard random dithering with ``levels`` linear levels (paper 004, Def. 3).

    Args:
        levels: s, the number of non-zero levels.
        p: the norm (``||x||_p``), default 2.
        compress_norm: send the norm naturally compressed in 1 byte (plus its
            16-byte header) instead of a float32.
        seed: random generator seed (None: nondeterministic).
    """

    natural_levels = False
    _code = 4


@register("natural_dithering")
class NaturalDithering(_GeneralDithering):
    """Natural dithering: levels ``2^(1-s), ..., 1/2, 1`` (paper 004, sec. 4)."""

    natural_levels = True
    _code = 5
