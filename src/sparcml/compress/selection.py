"""Shared pieces of the selectors: the k/density argument and NaN-safe magnitudes."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import compiled
from ..nonzero import MAGNITUDE_BITS  # (magnitudes order like the masked bit patterns)
from ..reinterpret import dense_1d
from ..stream import SparseStream
from ._kernels import CHUNK, chunks, scratch
from .base import Selector, check_input

__all__ = [
    "MAGNITUDE_BITS",
    "KSpec",
    "ReusedThreshold",
    "above_positions",
    "bracket_band",
    "count_above",
    "k_of",
    "magnitude",
    "max_magnitude",
    "scratch_magnitude",
    "select_above",
    "stream_of",
    "top_k_of_candidates",
]


class KSpec:
    """``k`` (entries) or ``density`` (fraction of entries), exactly one of them.

    * ``k = 0`` selects nothing; ``k > n`` raises (a silent clamp would hide a
      mis-sized layer).
    * ``density`` in (0, 1] selects ``max(1, round(density * n))`` entries of a
      non-empty tensor.
    """

    def __init__(self, k: int | None, density: float | None, what: str) -> None:
        if (k is None) == (density is None):
            raise ValueError(f"{what}: give exactly one of k and density")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise ValueError(f"{what}: k must be a non-negative integer, got {k!r}")
        if density is not None and not (0.0 < density <= 1.0 and math.isfinite(density)):
            raise ValueError(f"{what}: density must lie in (0, 1], got {density!r}")
        self.k = k
        self.density = density
        self.what = what

    def of(self, n: int) -> int:
        if self.k is not None:
            if self.k > n:
                raise ValueError(f"{self.what}: k={self.k} exceeds the tensor's {n} entries")
            return self.k
        assert self.density is not None
        return k_of(self.density, n)


def k_of(density: float, n: int) -> int:
    """The entries a ``density`` selects of ``n``: ``max(1, round(density * n))``,
    at most ``n``, 0 of an empty tensor. The one place density becomes ``k``."""
    return 0 if n == 0 else min(n, max(1, round(density * n)))


def magnitude(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``|x|`` with NaN mapped to +inf: NaN entries are selected first, never dropped.

    ``out``: write into this tensor (``x``'s shape and dtype), e.g. a reused scratch
    buffer, instead of two fresh ones (a fresh 64 MB tensor costs more in page
    faults than the pass that fills it).
    """
    if out is None:
        return torch.nan_to_num(x.abs(), nan=float("inf"))
    torch.abs(x, out=out)
    return out.nan_to_num_(nan=float("inf"))


def scratch_magnitude(x: torch.Tensor) -> torch.Tensor:
    """:func:`magnitude` of a 1-D ``x`` in this thread's reused buffer (CPU): valid
    until the next call on this thread, for a selection that drops it before then."""
    return magnitude(x, scratch("magnitude", x.numel(), x.dtype, x.device))


def stream_of(x: torch.Tensor, idx: torch.Tensor) -> SparseStream:
    """The entries ``idx`` (any order, unique) of the flat tensor ``x``."""
    idx = torch.sort(idx).values
    return SparseStream.from_sorted(idx, x[idx], x.numel())


def max_magnitude(x: torch.Tensor) -> float:
    """``max |x|`` in one pass without a temporary (NaN if any entry is NaN)."""
    if x.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(x)
    return (
        max(-float(lo), float(hi)) if not (bool(lo.isnan()) or bool(hi.isnan())) else float("nan")
    )


def _above(chunk: torch.Tensor, t: float, strict: bool, nan: bool = True) -> torch.Tensor:
    """Mask of ``|chunk| > t`` (``>=`` if not strict), in scratch buffers."""
    mag = scratch("above_abs", chunk.numel(), chunk.dtype, chunk.device)
    torch.abs(chunk, out=mag)
    mask = scratch("above_mask", chunk.numel(), torch.bool, chunk.device)
    if not nan:  # the caller knows there is no NaN: the plain comparison is one op less
        (torch.gt if strict else torch.ge)(mag, t, out=mask)
        return mask
    # NaN fails every comparison, so the negated test keeps it: NaN counts as +inf.
    (torch.le if strict else torch.lt)(mag, t, out=mask)
    return mask.logical_not_()


def _above_flags_f32(chunk: torch.Tensor, t: float, strict: bool) -> torch.Tensor:
    """int32 0/1 flags of ``|chunk| > t`` (``>=``) for float32, by bit patterns.

    Non-negative float32 values order like their bit patterns, and NaN patterns
    lie above +inf's, so NaN counts as the largest magnitude. Integer operations
    in place beat a float comparison that writes booleans by about 4x here.
    """
    tb = int(torch.tensor(t, dtype=torch.float32).view(torch.int32)) + (1 if strict else 0)
    flags = scratch("above_flags", chunk.numel(), torch.int32, chunk.device)
    torch.bitwise_and(chunk.view(torch.int32), 0x7FFFFFFF, out=flags)
    flags -= tb  # negative exactly where |x| is below the threshold
    flags >>= 31
    flags += 1
    return flags


def _above_positions_cpu(x: torch.Tensor, t: float, strict: bool) -> torch.Tensor:
    """CPU: the compiled scan and compaction in one pass per chunk, on bit patterns.

    Non-negative IEEE magnitudes order like their bit patterns with the sign masked
    off, and NaN patterns lie above +inf's, so NaN counts as the largest magnitude.
    The threshold is rounded to ``x``'s dtype first, as torch's comparison of a
    tensor with a Python scalar does. The chunks (``CHUNK`` entries, bounding the
    positions' scratch buffer) are cut from numpy views of the words and the
    buffer: a torch slice costs microseconds, and a bucket has dozens of chunks.
    """
    idtype, mask = MAGNITUDE_BITS[x.dtype]
    tb = int(torch.tensor(t, dtype=x.dtype).view(idtype)) + (1 if strict else 0)
    words = dense_1d(x).view(idtype)
    n = words.numel()
    scalars = _scan_scalars(idtype, mask, tb)
    if scalars is None:  # no word reaches it
        return torch.empty(0, dtype=torch.int64)
    mask_w, tb_w = scalars
    w = words.numpy()
    out = scratch("above_pos", min(n, CHUNK), torch.int64, x.device)
    buf = out.numpy()
    kernel = compiled().above_positions
    parts = []
    for lo in range(0, n, CHUNK):
        count = kernel(w[lo : lo + CHUNK], mask_w, tb_w, lo, buf)
        parts.append(torch.from_numpy(buf[:count].copy()))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def count_above(x: torch.Tensor, t: float, strict: bool = True) -> int:
    """How many entries have ``|x| > t`` (``>=`` if not ``strict``); NaN counts. Chunked."""
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for lo, hi in chunks(x.numel(), x.device):
        if x.dtype == torch.float32 and t >= 0:
            total += _above_flags_f32(x[lo:hi], t, strict).sum()
        else:
            total += _above(x[lo:hi], t, strict).sum()
    return int(total)


def select_above(x: torch.Tensor, t: float, strict: bool = True, nan: bool = True) -> torch.Tensor:
    """Sorted int64 positions with ``|x| > t`` (``>=`` if not ``strict``); NaN included.

    ``nan=False`` promises that ``x`` holds no NaN (a faster test).
    """
    if x.device.type == "cpu" and t >= 0 and x.numel():
        return _above_positions_cpu(x, t, strict)
    parts = []
    for lo, hi in chunks(x.numel(), x.device):
        parts.append(_above(x[lo:hi], t, strict, nan).nonzero().flatten() + lo)
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class ReusedThreshold(Selector):
    """A selector that finds a threshold every ``interval`` calls and reuses it in
    between, as long as what it selects stays in its band (a drifting gradient
    triggers a new search at once). Subclasses give :meth:`find` (the search) and
    :meth:`reuse` (the selection with the kept threshold, None when out of band).

    Args:
        k / density: target count (exactly one).
        interval: calls between searches (1 = search every call).
    """

    def __init__(self, k: int | None, density: float | None, interval: int) -> None:
        self.spec = KSpec(k, density, self.name)
        if interval < 1:
            raise ValueError(f"{self.name}: interval must be at least 1, got {interval}")
        self.k, self.density, self.interval = k, density, interval
        self.calls = 0
        self.threshold: float | None = None

    def find(self, x: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
        """A new threshold and the positions it selects."""
        raise NotImplementedError

    def reuse(self, x: torch.Tensor, k: int, threshold: float) -> torch.Tensor | None:
        """The positions ``threshold`` selects, or None when out of the band."""
        raise NotImplementedError

    def select(self, tensor: torch.Tensor) -> SparseStream:
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        if k == 0:
            return SparseStream.empty(x.numel(), x.dtype, x.device)
        idx = None
        if self.threshold is not None and self.calls % self.interval != 0:
            idx = self.reuse(x, k, self.threshold)
        if idx is None:
            self.threshold, idx = self.find(x, k)
        self.calls += 1
        return SparseStream.from_sorted(idx, x[idx], x.numel())


def above_positions(words: torch.Tensor, mask: int, tb: int, offset: int, out: torch.Tensor) -> int:
    """CPU only: positions (plus ``offset``) of the ``words`` with ``words & mask >= tb``
    written into ``out`` (int64, as long as ``words``), in one compiled pass; returns
    how many. The threshold scan of :func:`sparcml.compress.selection.select_above`
    on IEEE bit patterns (``mask`` drops the sign bit).

    ``mask`` and ``tb`` go in as scalars of the words' own integer type: as Python
    ints, numba compares in int64 and widens every 32-bit word first, about 1.4x
    slower (``benchmarks/topk_one_pass.py --nonzeros``)."""
    scalars = _scan_scalars(words.dtype, mask, tb)
    if scalars is None:  # no word reaches it
        return 0
    kernel = compiled().above_positions
    return int(kernel(words.numpy(), *scalars, offset, out.numpy()))


def _scan_scalars(idtype: torch.dtype, mask: int, tb: int) -> tuple[np.generic, np.generic] | None:
    """The scan's mask and threshold as scalars of the words' own type (numba then
    compares without widening every word), the threshold clamped to the type's
    range; None when no word can reach it."""
    info = torch.iinfo(idtype)
    if tb > info.max:
        return None
    kind = _NUMPY_INT[idtype]
    return kind(mask), kind(max(tb, info.min))


#: the numpy scalar type of each integer view of the floats' bits
_NUMPY_INT = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
#: +inf's bit pattern in each float width the compiled top-k takes
_INF_BITS = {torch.float32: 0x7F80_0000, torch.float64: 0x7FF0_0000_0000_0000}


def top_k_of_candidates(
    x: torch.Tensor, cand: torch.Tensor, k: int, out: torch.Tensor
) -> tuple[int, int, bool]:
    """CPU only, a float32/float64 ``x`` (contiguous): the exact top-k by magnitude
    among the sorted positions ``cand`` (at least ``k`` of them), in
    :func:`magnitude`'s order (NaN largest, +-inf with the largest finite value),
    in one compiled call: the k-th largest magnitude's bit pattern ``tb``, the
    positions above it, then the first ones at it in index order, ``k`` in all,
    written into ``out`` (int64); returns ``(tb, k, whether a candidate is NaN or
    +-inf)``."""
    idtype, mask = MAGNITUDE_BITS[x.dtype]
    kind = _NUMPY_INT[idtype]
    kernel = compiled().top_k_of_candidates
    tb, count, nonfinite = kernel(
        x.view(idtype).numpy(), cand.numpy(), kind(mask), kind(_INF_BITS[x.dtype]), k,
        out.numpy(),
    )  # fmt: skip
    return int(tb), int(count), bool(nonfinite)


def bracket_band(
    mag: torch.Tensor, t_lo: float, t_hi: float, band: torch.Tensor
) -> tuple[int, int]:
    """CPU only, float32/float64 magnitudes without NaN: how many exceed ``t_hi``, and
    the values in ``[t_lo, t_hi]`` written into ``band`` (as long as ``mag``, same
    dtype), in one compiled pass; returns (above, band count). The counting pass of
    :func:`sparcml.compress.threshold_reuse.kth_largest`."""
    above, n = compiled().bracket_band(mag.numpy(), t_lo, t_hi, band.numpy())
    return int(above), int(n)
