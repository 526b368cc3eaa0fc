"""Merging sorted runs of indices: the summation kernel of sparse streams.

Every sparse sum in the library adds streams whose indices are already sorted
and unique (the pieces of one index range in a split phase, two partial sums in
recursive doubling). Sorting their concatenation again costs ``O(K log K)``
with a large constant; a merge is linear. :func:`merge_sum` returns the sorted
union of the runs and the values summed **in run order** (run 0's value, plus
run 1's, ...), so the bits are the same on every rank and every run.

Values are accumulated into a scratch of ``-0.0`` (the identity of IEEE addition:
``-0.0 + x`` is ``x`` for every ``x``, ``+0.0`` and ``-0.0`` included), so a value
present in one run is carried bit for bit, explicitly stored zeros included,
and NaN/Inf propagate as in a dense sum.

One implementation per device:

* CPU: compiled kernels (numba, ``nogil``: in-process ranks merge in parallel)
  compute each input's position in the union: two runs by a linear merge; more
  runs, when they span at most 64 positions per entry (a split phase's pieces of
  one range), by a bitmap of the span (set a bit per entry, read the union off
  the set bits, each position = the set bits before it: 4.7 ns per entry against
  22 ns for a k-way merge of 8 runs), else by a k-way merge; ``index_add_`` adds
  the values run by run;
* other devices (CUDA): torch ops (a stable sort of the concatenation, then
  ``unique_consecutive``), the same positions and the same run-by-run adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from .reinterpret import index_low_bytes, indices_from_low_bytes, write_low_bytes

__all__ = [
    "above_positions",
    "bracket_band",
    "merge_positions",
    "merge_sum",
    "natural9_decode",
    "natural9_encode",
    "warm_kernels",
    "widen_increasing",
    "write_index_field",
]


def _compiled() -> ModuleType:
    """The library's compiled CPU kernels (merges, index widening, the threshold scan of
    :func:`sparcml.compress.selection.select_above`): :mod:`sparcml.cpu_kernels`,
    imported on first use (numba, a declared dependency, takes a moment to load;
    it compiles the kernels once and caches them on disk)."""
    import sparcml.cpu_kernels

    return sparcml.cpu_kernels


def warm_kernels() -> None:
    """Load the compiled CPU kernels now and run each once on a few entries.

    A process's first call of a compiled kernel loads it from numba's disk cache
    (compiles it, the first time on a machine) and starts numba's runtime: about
    0.3 s, 1 s or more with compilation. Inside a collective that stalls every other
    rank for as long, at whatever step the kernel is first needed; training states
    (:class:`sparcml.torch.SparcmlState`) call this when they are built instead.
    """
    runs = [torch.tensor([1, 5]), torch.tensor([2, 5]), torch.tensor([3])]
    merge_positions(runs[:2])  # two runs
    merge_positions(runs)  # a bitmap of their span
    merge_positions([torch.tensor([1, 1000]), *runs[1:]])  # a k-way merge
    out = torch.empty(2, dtype=torch.int64)
    for c in (1, 2, 3, 4, 8):  # 3: the compiled pass of every width that is not a word
        widen_increasing(index_low_bytes(torch.tensor([1, 2]), c), c, 4, out)
    write_index_field(torch.empty(6, dtype=torch.uint8), torch.tensor([1, 2]), 3)
    for dtype in (torch.int16, torch.int32, torch.int64):
        above_positions(torch.tensor([1, 3], dtype=dtype), -1, 2, 0, out)
    for dtype in (torch.float32, torch.float64):
        mags = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
        bracket_band(mags, 0.75, 1.5, torch.empty_like(mags))
    codes = torch.empty(4, dtype=torch.uint8)
    for deterministic in (False, True):
        bits = torch.tensor([1.5, -3.0], dtype=torch.float32).view(torch.int32)
        natural9_encode(bits, bits, deterministic, codes[:2], codes[2:3])
    natural9_decode(codes[:2], codes[2:3], torch.empty(2, dtype=torch.int32))


def merge_positions(runs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted union of sorted, unique int64 runs, and where each input lands in it.

    Args:
        runs: 1-D int64 tensors on one device, each strictly increasing (unchecked).

    Returns:
        ``(union, pos)``: ``union`` strictly increasing; ``pos`` (one entry per
        input, runs concatenated) the position of each input index in ``union``.

    Example:
        >>> u, p = merge_positions([torch.tensor([1, 5]), torch.tensor([2, 5])])
        >>> u.tolist(), p.tolist()
        ([1, 2, 5], [0, 2, 1, 2])
    """
    device = runs[0].device
    total = sum(r.numel() for r in runs)
    if device.type != "cpu":
        cat = torch.cat(list(runs))
        order = torch.argsort(cat, stable=True)
        union, inverse = torch.unique_consecutive(cat[order], return_inverse=True)
        pos = torch.empty_like(inverse)
        pos[order] = inverse
        return union, pos
    k = _compiled()
    pos = torch.empty(total, dtype=torch.int64)
    union = torch.empty(total, dtype=torch.int64)
    runs = [r.contiguous() for r in runs]
    if len(runs) == 2:
        n = k.merge2(runs[0].numpy(), runs[1].numpy(), pos.numpy(), union.numpy())
    else:
        cat = torch.cat(runs)
        full = [r for r in runs if r.numel()]
        lo = min(int(r[0]) for r in full) if full else 0
        width = max(int(r[-1]) for r in full) - lo + 1 if full else 0
        if width <= 64 * total:
            # a bitmap of the covered span (at most one word per input entry)
            n = k.merge_bitmap(cat.numpy(), lo, width, pos.numpy(), union.numpy())
        else:
            offsets = torch.tensor([0, *(r.numel() for r in runs)], dtype=torch.int64).cumsum(0)
            n = k.merge_k(cat.numpy(), offsets.numpy(), pos.numpy(), union.numpy())
    return union[:n], pos


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASKS = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFF_FFFF, 8: -1}


def widen_increasing(
    words: torch.Tensor, c: int, size: int, out: torch.Tensor, offset: int = 0
) -> int:
    """``out = words + offset`` as int64 from unsigned ``c``-byte words, checked in one pass.

    The wire's index fields (``c`` = 1 to 8 bytes, little-endian, unsigned; an 8-byte
    field is read as a signed ``int64``) are widened into ``out`` (int64, same length)
    while the same pass checks that they strictly increase and lie in ``[0, size)``.

    Returns:
        ``-1`` when they do; else where they stop: ``i > 0`` not increasing at
        ``i``, ``0`` a negative first index, ``len(words)`` the last one ``>= size``
        (``out`` then holds a prefix only).

    One implementation per device: the compiled pass on CPU, torch ops elsewhere.
    """
    if not words.numel():
        return -1
    assembled = c not in _SIGNED  # 3, 5, 6 or 7 bytes: no machine word of that width
    if not assembled:
        words = words.view(_SIGNED[c])
    if words.device.type == "cpu":
        return int(
            _compiled().widen_increasing(
                words.numpy(), c, assembled, _MASKS.get(c, -1), out.numpy(), offset, size
            )
        )
    if assembled:
        wide = indices_from_low_bytes(words, c)
    else:
        wide = words.to(torch.int64)
        if c < 8:
            wide &= _MASKS[c]
    n = wide.numel()
    if n > 1:
        bad = torch.nonzero(wide[1:] <= wide[:-1])
        if bad.numel():
            return int(bad[0]) + 1
    if int(wide[0]) < 0:
        return 0
    torch.add(wide, offset, out=out)
    return n if int(wide[-1]) >= size else -1


def write_index_field(out: torch.Tensor, indices: torch.Tensor, c: int) -> None:
    """The wire's index field: the low ``c`` bytes of each index into the uint8 ``out``.

    :func:`~sparcml.reinterpret.write_low_bytes`, with one compiled pass on CPU for a
    width that is not a machine word (3, 5, 6, 7), where torch would copy byte by
    byte through strides.
    """
    if c in _SIGNED or out.device.type != "cpu" or out.stride(0) != 1 or not out.numel():
        write_low_bytes(out, indices, c)
        return
    _compiled().narrow_bytes(indices.to(torch.int64).contiguous().numpy(), c, out.numpy())


def above_positions(words: torch.Tensor, mask: int, tb: int, offset: int, out: torch.Tensor) -> int:
    """CPU only: positions (plus ``offset``) of the ``words`` with ``words & mask >= tb``
    written into ``out`` (int64, as long as ``words``), in one compiled pass; returns
    how many. The threshold scan of :func:`sparcml.compress.selection.select_above`
    on IEEE bit patterns (``mask`` drops the sign bit)."""
    return int(_compiled().above_positions(words.numpy(), mask, tb, offset, out.numpy()))


def bracket_band(
    mag: torch.Tensor, t_lo: float, t_hi: float, band: torch.Tensor
) -> tuple[int, int]:
    """CPU only, float32/float64 magnitudes without NaN: how many exceed ``t_hi``, and
    the values in ``[t_lo, t_hi]`` written into ``band`` (as long as ``mag``, same
    dtype), in one compiled pass; returns (above, band count). The counting pass of
    :func:`sparcml.compress.threshold_reuse.kth_largest`."""
    above, n = _compiled().bracket_band(mag.numpy(), t_lo, t_hi, band.numpy())
    return int(above), int(n)


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
    top, clipped = _compiled().natural9_encode(
        bits.numpy(), rand.numpy(), deterministic, exps.numpy(), plane.numpy()
    )
    return int(top), int(clipped)


def natural9_decode(exps: torch.Tensor, plane: torch.Tensor, out: torch.Tensor) -> None:
    """CPU only: the float32 bit patterns (into int32 ``out``) of 9-bit natural codes."""
    _compiled().natural9_decode(exps.numpy(), plane.numpy(), out.numpy())


def merge_sum(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of sparse runs ``(indices[r], values[r])``, added in run order (see module doc).

    Example:
        >>> i, v = merge_sum([torch.tensor([1, 5]), torch.tensor([5])],
        ...                  [torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
        >>> i.tolist(), v.tolist()
        ([1, 5], [1.0, 5.0])
    """
    union, pos = merge_positions(indices)
    out = torch.full((union.numel(),), -0.0, dtype=values[0].dtype, device=union.device)
    start = 0
    for v in values:
        n = v.numel()
        if n:
            out.index_add_(0, pos[start : start + n], v)
        start += n
    return union, out
