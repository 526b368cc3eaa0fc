"""Top-k by a reused threshold (Ok-Topk, paper 001: "threshold reuse").

The exact k-th largest magnitude ``t`` is computed every ``interval`` calls
(Ok-Topk's tau'); that call selects exactly the top-k (ties at ``t`` broken by
position). The calls in between select ``|x| >= t`` with the stored ``t``, one
comparison pass instead of a top-k. Gradients change slowly between iterations,
so the count stays close to ``k``.

Count band: exactly ``k`` on a refresh call; ``[k/2, 2k]`` on a reuse call.
Beyond the paper: a reuse call whose count leaves that band (the gradient
drifted, or many entries tie at ``t``) refreshes at once, so the band holds on
every call. Zeros are never selected (a zero threshold selects ``|x| > 0``), so
a tensor with fewer than ``k`` non-zeros gives all of them.
"""

from __future__ import annotations

import torch

from ..reinterpret import dense_1d
from ._kernels import scratch
from .base import register
from .selection import (
    MAGNITUDE_BITS,
    ReusedThreshold,
    bracket_band,
    magnitude,
    scratch_magnitude,
    select_above,
    top_k_of_candidates,
)

__all__ = [
    "BRACKET_MIN",
    "ThresholdReuse",
    "kth_largest",
    "kth_magnitude",
    "top_k_exact",
    "top_k_exact_checked",
    "top_k_positions",
]


#: below this many entries :func:`kth_largest` is one ``torch.topk``
BRACKET_MIN = 1 << 16
#: entries of the strided sample that brackets the k-th largest value
_SAMPLE = 1 << 14


def _stride(n: int) -> int:
    """The stride of the bracketing sample of ``n`` entries (about ``2^14`` of them)."""
    return n // _SAMPLE


def _bracket(sample: torch.Tensor, k: int, n: int) -> tuple[float, float]:
    """``(t_lo, t_hi)`` around the ``k``-th largest of ``n`` values from the
    magnitudes of a strided ``sample`` of them: four standard deviations of the
    sample's count on each side (``t_hi = inf`` when the margin reaches the top)."""
    s = sample.numel()
    expect = k * s / n
    margin = int(4.0 * expect**0.5) + 8
    top = torch.topk(sample, min(s, int(expect) + margin + 1)).values  # descending
    hi_rank = int(expect) - margin  # sample rank (0-based) of t_hi
    t_hi = float(top[hi_rank]) if hi_rank >= 0 else float("inf")
    return float(top[-1]), t_hi


def kth_largest(mag: torch.Tensor, k: int) -> float:
    """The exact ``k``-th largest value of ``mag`` (1-D, ``1 <= k <= numel``, no NaN).

    Small inputs: one ``torch.topk``. Large ones (beyond the papers, which only
    ask for the exact value): a strided sample of ``2^14`` entries
    brackets the value, ``t_lo <= t <= t_hi``, with a margin of four standard
    deviations of the sample's count on each side; one pass counts the entries
    above ``t_hi`` and gathers those in ``[t_lo, t_hi]`` (about
    ``8 sqrt(k s / N) N / s`` of them; a compiled scan on CPU, torch's masks on
    other devices), and the answer is an exact top-k of that small set. A
    bracket that misses (adversarial data) falls back to the full ``torch.topk``;
    the result is exact either way. On large CPU tensors the bracketed search is
    several times faster than one full ``torch.topk`` (``sparcml bench-local``
    times both).
    """
    n = mag.numel()
    if n < BRACKET_MIN or k > n // 4:
        return float(torch.topk(mag, k, sorted=False).values.min())
    t_lo, t_hi = _bracket(mag[:: _stride(n)], k, n)
    if mag.device.type == "cpu" and mag.dtype in (torch.float32, torch.float64):
        # the count and the band in one compiled scan
        buf = scratch("kth_band", n, mag.dtype, mag.device)
        above, nb = bracket_band(dense_1d(mag), t_lo, t_hi, buf)
        band = buf[:nb]
    else:
        above = int(torch.count_nonzero(mag > t_hi)) if t_hi != float("inf") else 0
        band = mag[(mag >= t_lo) & (mag <= t_hi)] if above < k else mag[:0]
    need = k - above
    if need > 0 and band.numel() >= need:
        return float(torch.topk(band, need, sorted=False).values.min())
    return float(torch.topk(mag, k, sorted=False).values.min())


def top_k_exact(x: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """The exact top-k of a 1-D ``x`` by magnitude in :func:`~.selection.magnitude`'s
    order (NaN largest, +-inf with the largest finite value): ``(t, positions)``,
    ``t`` the ``k``-th largest magnitude, the positions sorted, ties at ``t`` broken
    by position (:func:`top_k_positions`); ``1 <= k <= numel``.

    Float32/float64 tensors on the CPU of ``2^16`` entries and more, ``k`` at most
    a quarter of them, in one pass over ``x`` (beyond the papers, which only ask
    for the exact top-k): the sample of :func:`kth_largest` gives ``t_lo``, as a
    rule below the k-th largest; one compiled scan of ``x``'s bit patterns (sign
    masked off: magnitudes order like them) keeps the positions with ``|x| >=
    t_lo`` (about ``k`` plus the band); the k-th largest and the selection come
    from those few. No magnitude tensor is written, so the selection reads ``x``
    once where :func:`kth_largest` + :func:`top_k_positions` wrote ``|x|`` and read
    it twice (``benchmarks/topk_one_pass.py`` times both). When the sample's top
    reaches zeros, one scan for the non-zeros decides: fewer than ``k``, and ``t =
    0`` with them as positions. The general path answers
    everything else: a sample that misses (fewer than ``k`` at or above
    ``t_lo``, infinities counted as the largest finite value), a sample reaching
    zeros with ``k`` non-zeros or more, other sizes, dtypes and devices; the same
    bits either way.
    """
    t, idx, _ = top_k_exact_checked(x, k)
    return t, idx


def top_k_exact_checked(x: torch.Tensor, k: int) -> tuple[float, torch.Tensor, bool | None]:
    """:func:`top_k_exact`, and whether ``x`` holds no NaN or +-inf where the one
    pass can tell (None where it cannot): its scan keeps every entry at or above
    ``t_lo``, the non-finite ones among them, so a caller that must check ``x``
    for them (``nan_policy="propagate"``) need not read ``x`` again."""
    found = _by_bits(x, k, positions=True) if _by_bits_applies(x, k) else None
    if found is not None:
        t, idx, finite = found
        assert idx is not None
        return t, idx, finite
    mag = scratch_magnitude(x)  # (dropped before this call returns)
    t = kth_largest(mag, k)
    return t, top_k_positions(mag, t, k), None


def kth_magnitude(x: torch.Tensor, k: int) -> float:
    """The ``k``-th largest magnitude of a 1-D ``x`` (:func:`top_k_exact`'s ``t``,
    without the positions): Ok-Topk's local threshold."""
    found = _by_bits(x, k, positions=False) if _by_bits_applies(x, k) else None
    if found is not None:
        return found[0]
    return kth_largest(scratch_magnitude(x), k)


def _by_bits_applies(x: torch.Tensor, k: int) -> bool:
    n = x.numel()
    floats = x.dtype in (torch.float32, torch.float64)
    return x.device.type == "cpu" and floats and n >= BRACKET_MIN and k <= n // 4


def _by_bits(
    x: torch.Tensor, k: int, positions: bool
) -> tuple[float, torch.Tensor | None, bool | None] | None:
    """:func:`top_k_exact`'s one pass: ``(t, positions or None, whether x is
    finite or None when not known)``, or None when the general path must answer."""
    n = x.numel()
    t_lo, _ = _bracket(magnitude(x[:: _stride(n)]), k, n)
    if t_lo == 0:  # the sample's top reaches zeros: the scan would keep every entry
        # one scan for the non-zeros (NaN counts, as |x| > 0 does): fewer than k, and
        # the top-k holds zeros: t = 0, and top_k_positions's answer, the non-zeros
        nonzero = select_above(x, 0.0)
        if nonzero.numel() >= k:
            return None
        return 0.0, nonzero if positions else None, None
    flat = dense_1d(x)  # (the scan's positions index it)
    cand = select_above(flat, t_lo, strict=False)  # sorted; NaN and +-inf included
    if cand.numel() < k:
        return None  # the sample missed
    # the candidates' k-th largest magnitude and top-k in one compiled call (+-inf
    # as the largest finite value, NaN as +inf: nan_to_num's mapping)
    out = scratch("top_k_of_candidates", cand.numel(), torch.int64, x.device)
    tb, count, nonfinite = top_k_of_candidates(flat, cand, k, out)
    idtype, _ = MAGNITUDE_BITS[x.dtype]
    if tb < int(torch.tensor(t_lo, dtype=x.dtype).view(idtype)):
        # fewer than k candidates reach t_lo once infinities count as the largest
        # finite value (t_lo = inf): entries below t_lo may belong to the top-k
        return None
    t = float(torch.tensor(tb, dtype=idtype).view(x.dtype))
    # (every NaN and +-inf of x is a candidate: they reach any finite t_lo, and
    # t_lo = inf keeps them all)
    return t, out[:count].clone() if positions else None, not nonfinite


def top_k_positions(mag: torch.Tensor, t: float, k: int) -> torch.Tensor:
    """Sorted positions of the top-k of ``mag`` given its k-th largest value ``t``.

    Every entry above ``t``, then the first entries equal to ``t`` in index order
    up to ``k`` in all (deterministic ties); with ``t = 0`` only the non-zeros.
    """
    if t == 0:
        return select_above(mag, t, nan=False)
    # one scan for |x| >= t (k or more entries: t is the k-th largest); only when
    # entries tie at t are the tied ones past the first k - (entries above t) dropped,
    # from the selection alone
    at_least = select_above(mag, t, strict=False, nan=False)
    if at_least.numel() <= k:
        return at_least
    tied = mag[at_least] == t
    keep = ~tied
    first = tied.nonzero().flatten()[: k - int(keep.sum())]
    keep[first] = True
    return at_least[keep]


@register("threshold_reuse")
class ThresholdReuse(ReusedThreshold):
    """``|x| >= t``, with ``t`` the exact k-th magnitude refreshed every ``interval`` calls.

    Args:
        k / density: target count (exactly one).
        interval: calls between exact recomputations (Ok-Topk's tau'; 1 = always exact).
    """

    def __init__(
        self, k: int | None = None, density: float | None = None, interval: int = 32
    ) -> None:
        super().__init__(k, density, interval)
        self.refreshes = 0

    def find(self, x: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
        self.refreshes += 1
        return top_k_exact(x, k)

    def reuse(self, x: torch.Tensor, k: int, threshold: float) -> torch.Tensor | None:
        idx = select_above(x, threshold, strict=threshold == 0)
        in_band = (k + 1) // 2 <= idx.numel() <= 2 * k or (threshold == 0 and idx.numel() < k)
        return idx if in_band else None  # else: out of the band, refresh now
