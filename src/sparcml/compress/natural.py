"""Natural compression C_nat (paper 004, sec. 3 and appendix A).

C_nat rounds ``x != 0`` with ``2^a <= |x| < 2^(a+1)`` to ``sign(x) 2^a`` with
probability ``(2^(a+1) - |x|) / 2^a`` and to ``sign(x) 2^(a+1)`` otherwise:
unbiased, with variance factor ``omega = 1/8`` (Thm 1:
``E[C(x)^2] <= 9/8 x^2``). On float32 bits (sec. 3.2) this is: drop the mantissa
``m`` and add one to the exponent with probability ``m / 2^23`` — a comparison
of ``m`` with a random 23-bit integer. Subnormals round between 0 and
``2^-126`` the same way (unbiased); float16/bfloat16/float64 input goes through
float32.

Wire formats:

* ``format=9`` (sec. 3.2): sign + the 8-bit float32 exponent: ``n`` exponent
  bytes, then the signs as a bit plane: ``ceil(9n/8)`` bytes. Exponent 255 is
  infinity, so values in the top binade ``[2^127, 2^128)`` that round up are
  clipped to ``2^127`` (biased; counted in ``clipped``, like the 8-bit format's).
* ``format=8`` (appendix A): one byte per value, ``sign<<7 | zero<<6 | e - e_min``,
  exponents clipped to ``[e_min, e_min + 63]`` (6 bits; default e_min = -50).
  Below ``2^e_min`` values round stochastically between 0 and ``2^e_min``
  (unbiased); above ``2^(e_min+63)`` they are clipped (biased; counted in
  ``clipped``).

Range of the variance bound: Thm 1's ``E[C(x)^2] <= 9/8 x^2`` holds for
``|x|`` inside the format's range of normal powers of two, ``[2^-126, 2^127]``
(9-bit) or ``[2^e_min, 2^(e_min+63)]`` (8-bit). Below it, both formats flush
the same way: stochastically to 0 or to the smallest power ``2^e_lo`` with
probability ``|x| / 2^e_lo`` (float32 subnormals included). That stays
unbiased, but the variance is ``|x| 2^e_lo - x^2``, more than ``x^2 / 8`` once
``|x| < 8/9 * 2^e_lo``: choose ``e_min`` below the gradients' scale. Above the
range values are clipped (biased, counted in ``clipped``).

``deterministic=True`` rounds to the nearer power of two instead (the paper's
"without stochastic rounding" reference; biased, no random numbers).

Natural-compressed values are powers of two: a sum of them is an integer sum of
shifted ones, which is what an integer-only aggregator exploits (``summable``).

Implementation (beyond the paper): the 9-bit format runs, on CPU tensors, as
compiled passes per cache-sized chunk (:func:`natural9_encode`,
numba) that read the float32 bits and the chunk's random draws and write the
exponents and the packed signs, and decodes in one pass the same way; on CUDA
it runs the torch operations of :func:`natural_round`. Both consume the same
draws from the generator and give the same bits (tested). Compiled, decoding is
several times faster than the torch operations, and quantizing costs little more
than the generator's draws, the floor of any implementation that draws from a
torch generator (``sparcml bench-local`` times both; docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from ..errors import WireFormatError
from ..kernels import compiled
from ..reinterpret import dense_1d
from ._kernels import chunks, exact_bernoulli, scratch
from .base import Quantizer, check_finite, make_header, read_header, register, to_saturating
from .packing import pack_bools_into, unpack_bits

__all__ = ["NaturalCompression", "natural9_decode", "natural9_encode", "natural_round"]

_MANT = (1 << 23) - 1


def natural_round(
    values: torch.Tensor, generator: torch.Generator | None, deterministic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
    """C_nat of float32 ``values``: ``(sign bit, biased float32 exponent, finite, clipped)``.

    Sign and exponent are int32 tensors in this thread's scratch buffers (valid
    until the next call). Exponent 0 means the value rounded to zero; ``finite``
    is False if any input was NaN or Inf (exponent 255); ``clipped`` counts the
    finite values that rounded up to ``2^128`` and were clipped to ``2^127``.
    """
    bits = values.contiguous().view(torch.int32)
    m = bits.numel()
    exp = scratch("nat_exp", m, torch.int32, bits.device)
    torch.bitwise_right_shift(bits, 23, out=exp)
    exp &= 0xFF
    finite = int(exp.max()) < 255 if m else True
    mant = scratch("nat_mant", m, torch.int32, bits.device)
    torch.bitwise_and(bits, _MANT, out=mant)
    if deterministic:  # round to the nearer power of two: up iff m >= 2^22
        mant >>= 22
        exp += mant
    else:  # P(up) = m / 2^23, exactly
        exp += exact_bernoulli(mant, 23, generator)
    clipped = 0
    if finite and m and int(exp.max()) == 255:
        # rounded up out of the top binade: 2^128 is infinity, clip to 2^127 (counted)
        clipped = int((exp == 255).sum())
    exp.clamp_(max=254)
    sign = mant  # reuse: the mantissa is no longer needed
    torch.bitwise_right_shift(bits, 31, out=sign)
    sign &= 1
    return sign, exp, finite, clipped


@register("natural")
class NaturalCompression(Quantizer):
    """Natural compression: stochastic rounding to a power of two, 9 or 8 bits per value.

    Args:
        format: 9 (sign + float32 exponent) or 8 (appendix A's clipped exponent).
        deterministic: round to the nearer power of two (biased) instead of stochastically.
        e_min: smallest exponent of the 8-bit format (``2^e_min`` .. ``2^(e_min+63)``).
        seed: seed of the random generator (None: nondeterministic).
        check_finite: refuse NaN/Inf input (else NaN/Inf become the largest magnitude).
    """

    summable = True

    def __init__(
        self,
        format: int = 9,
        deterministic: bool = False,
        e_min: int = -50,
        seed: int | None = 0,
        check_finite: bool = True,
    ) -> None:
        if format not in (8, 9):
            raise ValueError(f"natural: format must be 9 or 8 bits per value, got {format}")
        if not -126 <= e_min <= 127 - 63:
            raise ValueError(f"natural: e_min must lie in [-126, 64], got {e_min}")
        self.format, self.deterministic, self.e_min, self.seed = format, deterministic, e_min, seed
        self.check_finite = check_finite
        self.clipped = 0

    def expected_nbytes(self, n: int) -> int:
        return 16 + (n if self.format == 8 else n + (n + 7) // 8)

    def quantize(
        self, values: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        n = values.numel()
        v = dense_1d(values.to(torch.float32))
        gen = None if self.deterministic else (generator or self._generator(v.device))
        code = 2 if self.format == 9 else 3
        header = make_header(code, n, device=v.device)
        # one message, its header written in front (no concatenation afterwards)
        payload = torch.empty(
            header.numel() + (n + (n + 7) // 8 if self.format == 9 else n),
            dtype=torch.uint8, device=v.device,
        )  # fmt: skip
        payload[: header.numel()].copy_(header)
        out = payload[header.numel() :]
        if self.format == 9:
            exps, plane = out[:n], out[n:]
        compiled = self.format == 9 and v.device.type == "cpu"
        for lo, hi in chunks(n, v.device):
            if compiled:  # one compiled call per chunk; the draws as exact_bernoulli's
                bits = v[lo:hi].view(torch.int32)
                rand = scratch("bernoulli", hi - lo, torch.int32, v.device)
                if not self.deterministic:  # (no seed: torch's default generator)
                    rand.random_(generator=gen)
                top, clipped = natural9_encode(
                    bits, rand, self.deterministic, exps[lo:hi], plane[lo // 8 : (hi + 7) // 8]
                )
                finite = top < 255
                self.clipped += clipped if finite else 0
            elif self.format == 9:
                sign, exp, finite, clipped = natural_round(v[lo:hi], gen, self.deterministic)
                self.clipped += clipped
                exps[lo:hi].copy_(exp)
                pack_bools_into(plane[lo // 8 : (hi + 7) // 8], sign)
            else:
                codes, finite = self._encode8(v[lo:hi], gen)
                out[lo:hi] = codes
            if not finite and self.check_finite:
                check_finite(v, "natural")
        return payload

    def _encode8(self, v: torch.Tensor, gen: torch.Generator | None) -> tuple[torch.Tensor, bool]:
        lo = 2.0**self.e_min
        hi_e = self.e_min + 63
        mag = v.abs()
        # Below 2^e_min: 0 or 2^e_min with probability |x| / 2^e_min (unbiased).
        small = mag < lo
        if self.deterministic:
            small_up = mag >= lo / 2
        else:
            small_up = torch.rand(v.shape, generator=gen, device=v.device) * lo < mag
        sign_bit, exp, finite, _ = natural_round(v, gen, self.deterministic)
        sign = sign_bit.clone()
        exp = exp.clone()
        e = exp - 127
        over = e > hi_e
        self.clipped += int(over.sum())
        e = e.clamp(self.e_min, hi_e)
        zero = small & ~small_up
        e = torch.where(small, torch.full_like(e, self.e_min), e)
        code = (sign << 7) | (zero.to(torch.int32) << 6) | (e - self.e_min)
        return code.to(torch.uint8), finite

    def dequantize(
        self, payload: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        code = 2 if self.format == 9 else 3
        n, _, body = read_header(payload, code, f"natural ({self.format}-bit)")
        body = body.to(device)
        if self.format == 9:
            if body.numel() != n + (n + 7) // 8:
                raise WireFormatError(f"natural: payload of {body.numel()} bytes for {n} values")
            if torch.device(device).type == "cpu":
                bits = torch.empty(n, dtype=torch.int32)
                natural9_decode(body[:n], body[n:], bits)
                return to_saturating(bits.view(torch.float32), dtype)
            exp = body[:n].to(torch.int32)
            sign = unpack_bits(body[n:], n, 1)
            bits = (sign << 31) | (exp << 23)
            return to_saturating(bits.view(torch.float32), dtype)
        if body.numel() != n:
            raise WireFormatError(f"natural: payload of {body.numel()} bytes for {n} values")
        c = body.to(torch.int32)
        e = (c & 63) + self.e_min
        out = torch.ldexp(torch.ones(n, device=device), e.float())
        out = torch.where(((c >> 6) & 1).bool(), torch.zeros_like(out), out)
        out = torch.where(((c >> 7) & 1).bool(), -out, out)
        return to_saturating(out, dtype)

    def to_integers(self, payload: torch.Tensor) -> torch.Tensor:
        """An 8-bit payload's values as int64 multiples of ``2^e_min`` (for integer sums).

        Raises:
            OverflowError: a value at exponent offset 63 (``2^(e_min+63)``): its
                multiple ``2^63`` does not fit an int64 (choose a larger ``e_min``).
        """
        _, _, body = read_header(payload, 3, "natural (8-bit)")
        c = body.to(torch.int64)
        top = ((c & 63) == 63) & ~((c >> 6) & 1).bool()
        if bool(top.any()):
            raise OverflowError(
                f"natural: {int(top.sum())} value(s) at 2^(e_min+63) = 2^{self.e_min + 63} "
                "are 2^63 multiples of 2^e_min, beyond int64; use a larger e_min"
            )
        mag = torch.where(
            ((c >> 6) & 1).bool(), torch.zeros_like(c), torch.ones_like(c) << (c & 63)
        )
        return torch.where(((c >> 7) & 1).bool(), -mag, mag)


def natural9_encode(
    bits: torch.Tensor,
    rand: torch.Tensor,
    deterministic: bool,
    exps: torch.Tensor,
    plane: torch.Tensor,
) -> tuple[int, int]:
    """CPU only: 9-bit natural compression of float32 bit patterns in one compiled call.

    ``bits`` (int32): the values' IEEE bits; ``rand`` (int32, as long, uniform in
    ``[0, 2^31)``): the draws of :func:`sparcml.compress._kernels.exact_bernoulli`
    (ignored when ``deterministic``). Writes the rounded biased exponents into
    ``exps`` (uint8, as long) and the sign bits into ``plane`` (uint8,
    ``ceil(n / 8)`` bytes). Returns ``(largest exponent before rounding, number
    rounded up to 255 and clipped to 254)``. The same bits as the torch path of
    :meth:`sparcml.compress.natural.NaturalCompression.quantize` given the same draws.
    """
    top, clipped = compiled().natural9_encode(
        bits.numpy(), rand.numpy(), deterministic, exps.numpy(), plane.numpy()
    )
    return int(top), int(clipped)


def natural9_decode(exps: torch.Tensor, plane: torch.Tensor, out: torch.Tensor) -> None:
    """CPU only: the float32 bit patterns (into int32 ``out``) of 9-bit natural codes."""
    compiled().natural9_decode(exps.numpy(), plane.numpy(), out.numpy())
