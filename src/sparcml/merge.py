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

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["above_positions", "merge_positions", "merge_sum", "widen_increasing"]

_lock = threading.Lock()
_kernels: dict[str, Callable[..., Any]] = {}


def _compiled() -> dict[str, Callable[..., Any]]:
    """The library's compiled CPU kernels (merges, index widening, the threshold scan of
    :func:`sparcml.compress.selection.select_above`), compiled on first use and
    cached on disk by numba."""
    if _kernels:
        return _kernels
    with _lock:
        if _kernels:
            return _kernels
        import numba  # a declared dependency; imported lazily (compilation takes a moment)
        import numpy as np

        @numba.njit(cache=True, nogil=True)
        def merge2(a: Any, b: Any, pos: Any, union: Any) -> int:  # pragma: no cover - compiled
            la, lb = a.shape[0], b.shape[0]
            i = j = n = 0
            # branch-free: both positions written every step; the one whose run
            # does not advance is written again when it is taken (1.6x faster
            # than branching on random indices)
            while i < la and j < lb:
                x, y = a[i], b[j]
                union[n] = min(x, y)
                pos[i] = n
                pos[la + j] = n
                i += x <= y
                j += y <= x
                n += 1
            while i < la:
                union[n] = a[i]
                pos[i] = n
                i += 1
                n += 1
            while j < lb:
                union[n] = b[j]
                pos[la + j] = n
                j += 1
                n += 1
            return n

        @numba.njit(cache=True, nogil=True)
        def merge_k(idx: Any, offsets: Any, pos: Any, union: Any) -> int:  # pragma: no cover
            p = offsets.shape[0] - 1
            heads = offsets[:-1].copy()
            big = np.iinfo(np.int64).max
            n = 0
            while True:
                m = big
                for r in range(p):
                    h = heads[r]
                    if h < offsets[r + 1] and idx[h] < m:
                        m = idx[h]
                if m == big:
                    break
                for r in range(p):
                    h = heads[r]
                    if h < offsets[r + 1] and idx[h] == m:
                        pos[h] = n
                        heads[r] = h + 1
                union[n] = m
                n += 1
            return n

        one = np.uint64(1)
        m1, m2 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333)
        m4, h01 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)

        @numba.njit(cache=True, nogil=True, inline="always")
        def popcount(x: Any) -> Any:  # pragma: no cover - compiled
            x = x - ((x >> one) & m1)
            x = (x & m2) + ((x >> np.uint64(2)) & m2)
            x = (x + (x >> np.uint64(4))) & m4
            return (x * h01) >> np.uint64(56)

        @numba.njit(cache=True, nogil=True)
        def merge_bitmap(  # pragma: no cover - compiled
            idx: Any, lo: int, width: int, pos: Any, union: Any
        ) -> int:
            # every idx in [lo, lo + width): one bit per position (width / 8 bytes,
            # cache-resident), the union read off the set bits in order, each
            # input's position = set bits before it (popcounts of a word prefix)
            nw = (width + 63) >> 6
            bits = np.zeros(nw, np.uint64)
            for i in range(idx.shape[0]):
                x = idx[i] - lo
                bits[x >> 6] |= one << np.uint64(x & 63)
            before = np.empty(nw, np.int64)
            n = 0
            for w in range(nw):
                before[w] = n
                word = bits[w]
                base = lo + (w << 6)
                while word:
                    low = word & (~word + one)
                    union[n] = base + np.int64(popcount(low - one))
                    n += 1
                    word ^= low
            for i in range(idx.shape[0]):
                x = idx[i] - lo
                w = x >> 6
                below = (one << np.uint64(x & 63)) - one
                pos[i] = before[w] + np.int64(popcount(bits[w] & below))
            return n

        @numba.njit(cache=True, nogil=True)
        def widen_increasing(  # pragma: no cover - compiled
            words: Any, mask: int, out: Any, offset: int, size: int
        ) -> int:
            # out[i] = (words[i] & mask) + offset, checking in the same pass that the
            # words strictly increase and stay below size; -1 when they do, else where
            # they stop: i > 0 not increasing at i, 0 negative first, n out of range
            n = words.shape[0]
            prev = np.int64(-1)
            for i in range(n):
                x = np.int64(words[i]) & mask
                if x <= prev:
                    return i
                out[i] = x + offset
                prev = x
            if n and prev >= size:
                return n
            return -1

        @numba.njit(cache=True, nogil=True)
        def above_positions(  # pragma: no cover - compiled
            words: Any, mask: int, tb: int, offset: int, out: Any
        ) -> int:
            # the threshold scan and compaction in one pass: positions (plus offset)
            # of the entries whose magnitude bits (sign masked off) reach tb
            n = 0
            for i in range(words.shape[0]):
                if (words[i] & mask) >= tb:
                    out[n] = i + offset
                    n += 1
            return n

        _kernels["above_positions"] = above_positions
        _kernels["merge2"] = merge2
        _kernels["merge_k"] = merge_k
        _kernels["merge_bitmap"] = merge_bitmap
        _kernels["widen_increasing"] = widen_increasing
    return _kernels


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
        n = k["merge2"](runs[0].numpy(), runs[1].numpy(), pos.numpy(), union.numpy())
    else:
        cat = torch.cat(runs)
        full = [r for r in runs if r.numel()]
        lo = min(int(r[0]) for r in full) if full else 0
        width = max(int(r[-1]) for r in full) - lo + 1 if full else 0
        if width <= 64 * total:
            # a bitmap of the covered span (at most one word per input entry)
            n = k["merge_bitmap"](cat.numpy(), lo, width, pos.numpy(), union.numpy())
        else:
            offsets = torch.tensor([0, *(r.numel() for r in runs)], dtype=torch.int64).cumsum(0)
            n = k["merge_k"](cat.numpy(), offsets.numpy(), pos.numpy(), union.numpy())
    return union[:n], pos


_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASKS = {2: 0xFFFF, 4: 0xFFFF_FFFF, 8: -1}


def widen_increasing(
    words: torch.Tensor, c: int, size: int, out: torch.Tensor, offset: int = 0
) -> int:
    """``out = words + offset`` as int64 from unsigned ``c``-byte words, checked in one pass.

    The wire's index fields (``c`` = 2, 4 or 8 bytes, little-endian, read here as the
    signed integer of that width) are widened into ``out`` (int64, same length)
    while the same pass checks that they strictly increase and lie in ``[0, size)``.

    Returns:
        ``-1`` when they do; else where they stop: ``i > 0`` not increasing at
        ``i``, ``0`` a negative first index, ``len(words)`` the last one ``>= size``
        (``out`` then holds a prefix only).

    One implementation per device: the compiled pass on CPU, torch ops elsewhere.
    """
    n = words.numel()
    if not n:
        return -1
    words = words.view(_SIGNED[c])
    if words.device.type == "cpu":
        return int(
            _compiled()["widen_increasing"](words.numpy(), _MASKS[c], out.numpy(), offset, size)
        )
    wide = words.to(torch.int64)
    if c < 8:
        wide &= _MASKS[c]
    if n > 1:
        bad = torch.nonzero(wide[1:] <= wide[:-1])
        if bad.numel():
            return int(bad[0]) + 1
    if int(wide[0]) < 0:
        return 0
    torch.add(wide, offset, out=out)
    return n if int(wide[-1]) >= size else -1


def above_positions(words: torch.Tensor, mask: int, tb: int, offset: int, out: torch.Tensor) -> int:
    """CPU only: positions (plus ``offset``) of the ``words`` with ``words & mask >= tb``
    written into ``out`` (int64, as long as ``words``), in one compiled pass; returns
    how many. The threshold scan of :func:`sparcml.compress.selection.select_above`
    on IEEE bit patterns (``mask`` drops the sign bit)."""
    return int(_compiled()["above_positions"](words.numpy(), mask, tb, offset, out.numpy()))


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
