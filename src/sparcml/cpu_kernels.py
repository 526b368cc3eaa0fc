"""The compiled CPU kernels of :mod:`sparcml.merge` (numba, ``nogil``, cached on disk).

Imported by :mod:`sparcml.merge` on first use only (importing numba and
loading the kernels takes a moment). The kernels live at module level, their
constants as module globals: numba's on-disk cache can then find them again in
the next process (a kernel defined inside a function, closing over its
constants, is compiled anew by every process, inside whichever collective first
needs it: docs/training.md).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = [
    "above_positions",
    "all_finite_bits",
    "count_nonzero_bits",
    "drop_zero_pairs",
    "elias_fano_decode",
    "elias_fano_encode",
    "first_zero_bits",
    "merge2",
    "merge2_sum",
    "merge_bitmap",
    "merge_k",
    "narrow_bytes",
    "natural9_decode",
    "natural9_encode",
    "nonzero_bits_positions",
    "top_k_of_candidates",
    "widen_increasing",
]

_ONE = np.uint64(1)
_M1, _M2 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333)
_M4, _H01 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)
_TWO, _FOUR, _SHIFT = np.uint64(2), np.uint64(4), np.uint64(56)


@numba.njit(cache=True, nogil=True)
def merge2(a: Any, b: Any, pos: Any, union: Any) -> int:  # pragma: no cover - compiled
    la, lb = a.shape[0], b.shape[0]
    i = j = n = 0
    # branch-free: both positions written every step; the one whose run
    # does not advance is written again when it is taken (faster than
    # branching on random indices, where the branch is unpredictable)
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
def merge2_sum(  # pragma: no cover - compiled
    a: Any, av: Any, b: Any, bv: Any, union: Any, out: Any, neg0: Any
) -> int:
    # merge2 and the run-ordered sum in one pass: out[n] = (-0.0 + av[i]) + bv[j]
    # where both runs hold union[n], -0.0 + the value where one does (sparcml.merge: the same bits
    # as index_add_ into a scratch of -0.0, run by run); neg0: [-0.0] in the values'
    # dtype (a float64 constant would widen the sums)
    la, lb = a.shape[0], b.shape[0]
    i = j = n = 0
    zero = neg0[0]
    while i < la and j < lb:
        x, y = a[i], b[j]
        ta, tb = x <= y, y <= x
        union[n] = min(x, y)
        # all three candidates, then a select: no branch on random indices
        # (a conditional load of each value branched, and was 2.2x slower)
        first = zero + av[i]
        both = first + bv[j]
        out[n] = both if ta & tb else (first if ta else zero + bv[j])
        i += ta
        j += tb
        n += 1
    while i < la:
        union[n] = a[i]
        out[n] = zero + av[i]
        i += 1
        n += 1
    while j < lb:
        union[n] = b[j]
        out[n] = zero + bv[j]
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


@numba.njit(cache=True, nogil=True, inline="always")
def _popcount(x: Any) -> Any:  # pragma: no cover - compiled
    x = x - ((x >> _ONE) & _M1)
    x = (x & _M2) + ((x >> _TWO) & _M2)
    x = (x + (x >> _FOUR)) & _M4
    return (x * _H01) >> _SHIFT


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
        bits[x >> 6] |= _ONE << np.uint64(x & 63)
    before = np.empty(nw, np.int64)
    n = 0
    for w in range(nw):
        before[w] = n
        word = bits[w]
        base = lo + (w << 6)
        while word:
            low = word & (~word + _ONE)
            union[n] = base + np.int64(_popcount(low - _ONE))
            n += 1
            word ^= low
    for i in range(idx.shape[0]):
        x = idx[i] - lo
        w = x >> 6
        below = (_ONE << np.uint64(x & 63)) - _ONE
        pos[i] = before[w] + np.int64(_popcount(bits[w] & below))
    return n


@numba.njit(cache=True, nogil=True, inline="always")
def _field(raw: Any, base: int, c: int) -> int:  # pragma: no cover - compiled
    # the little-endian c-byte field at raw[base:base + c]; 3 bytes (the common
    # width that is not a word: N up to 2^24) spelled out: much faster than the loop
    if c == 3:
        return np.int64(raw[base]) | np.int64(raw[base + 1]) << 8 | np.int64(raw[base + 2]) << 16
    x = np.int64(0)
    for b in range(c):
        x |= np.int64(raw[base + b]) << (8 * b)
    return x


@numba.njit(cache=True, nogil=True)
def widen_increasing(  # pragma: no cover - compiled
    words: Any, c: int, assembled: bool, mask: int, out: Any, offset: int, size: int
) -> int:
    # out[i] = field i + offset, checking in the same pass that the fields
    # strictly increase and stay below size; -1 when they do, else where they
    # stop: i > 0 not increasing at i, 0 negative first, n out of range. The
    # fields are machine words (words[i] & mask) or, assembled, c bytes each of
    # the uint8 words (a width that is not a word: 3, 5, 6, 7)
    n = words.shape[0] // c if assembled else words.shape[0]
    prev = np.int64(-1)
    for i in range(n):
        x = _field(words, i * c, c) if assembled else np.int64(words[i]) & mask
        if x <= prev:
            return i
        out[i] = x + offset
        prev = x
    if n and prev >= size:
        return n
    return -1


_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_CTZ = np.zeros(64, dtype=np.int64)  # de Bruijn table: the position of a word's lowest set bit
for _i in range(64):
    _CTZ[((1 << _i) * 0x03F79D71B4CB0A89 & 0xFFFF_FFFF_FFFF_FFFF) >> 58] = _i
_U58, _BYTE = np.uint64(58), np.uint64(0xFF)
_T7, _T14, _T28 = np.uint64(7), np.uint64(14), np.uint64(28)
_K1, _K2 = np.uint64(0x00AA00AA00AA00AA), np.uint64(0x0000CCCC0000CCCC)
_K3 = np.uint64(0x00000000F0F0F0F0)


@numba.njit(cache=True, nogil=True, inline="always")
def _transpose8(x: Any) -> Any:  # pragma: no cover - compiled
    # the 8 x 8 bit matrix in a word (byte r, bit c) transposed: bit r of byte c
    # (Hacker's Delight, sec. 7-3): eight indices' low bits <-> eight bit planes
    t = (x ^ (x >> _T7)) & _K1
    x = x ^ t ^ (t << _T7)
    t = (x ^ (x >> _T14)) & _K2
    x = x ^ t ^ (t << _T14)
    t = (x ^ (x >> _T28)) & _K3
    return x ^ t ^ (t << _T28)


@numba.njit(cache=True, nogil=True)
def elias_fano_encode(  # pragma: no cover - compiled
    indices: Any,
    low_bits: int,
    a: int,
    b: int,
    plane_len: int,
    lows: Any,
    planes: Any,
    bitmap: Any,
) -> None:
    # sparcml.indexcode's Elias-Fano field of strictly increasing indices: the
    # low a bytes of each; bit 8a + j of each in plane j, eight indices at a time
    # through a bit transpose; bit (x >> low_bits) + i of the bitmap, a word at a
    # time (no branch on the data). The bitmap arrives zeroed.
    n = indices.shape[0]
    shift = 8 * a
    mask = (1 << b) - 1
    for g in range(plane_len):
        word = np.uint64(0)
        for t in range(min(8, n - 8 * g)):
            i = 8 * g + t
            x = indices[i]
            for k in range(a):
                lows[i * a + k] = (x >> (8 * k)) & 0xFF
            word |= np.uint64((x >> shift) & mask) << np.uint64(8 * t)
        if b:
            word = _transpose8(word)
            for j in range(b):
                planes[j * plane_len + g] = (word >> np.uint64(8 * j)) & _BYTE
    nbytes = bitmap.shape[0]
    at = -1
    word = np.uint64(0)
    for i in range(n):
        p = (indices[i] >> low_bits) + i
        if p >> 6 != at:
            for k in range(8):  # the finished word's bytes
                if at >= 0 and at * 8 + k < nbytes:
                    bitmap[at * 8 + k] = (word >> np.uint64(8 * k)) & _BYTE
            at = p >> 6
            word = np.uint64(0)
        word |= np.uint64(1) << np.uint64(p & 63)
    for k in range(8):
        if at >= 0 and at * 8 + k < nbytes:
            bitmap[at * 8 + k] = (word >> np.uint64(8 * k)) & _BYTE


@numba.njit(cache=True, nogil=True)
def elias_fano_decode(  # pragma: no cover - compiled
    lows: Any,
    a: int,
    planes: Any,
    b: int,
    plane_len: int,
    bitmap: Any,
    nbits: int,
    low_bits: int,
    size: int,
    out: Any,
    offset: int,
) -> int:
    # the inverse, checked: -1 when the field holds len(out) strictly increasing
    # indices below size; else i > 0 not increasing at i, len(out) the last one
    # >= size, -2 a bitmap that holds another count or a set bit past nbits.
    # Pass 1: the high parts, a bitmap word at a time (its set bits by de Bruijn
    # multiplication; a set bit past nbits can only sit in the last byte, checked
    # first); pass 2: the low bits ORed in, eight indices at a time.
    n = out.shape[0]
    nbytes = bitmap.shape[0]
    if nbits & 7 and nbytes and bitmap[nbytes - 1] >> (nbits & 7):
        return -2  # a set bit past the bitmap's end
    i = 0
    for q in range(0, nbytes, 8):
        word = np.uint64(0)
        if q + 8 <= nbytes:
            for k in range(8):
                word |= np.uint64(bitmap[q + k]) << np.uint64(8 * k)
        else:
            for k in range(nbytes - q):
                word |= np.uint64(bitmap[q + k]) << np.uint64(8 * k)
        base = q * 8 - i
        while word:
            lowest = word & (~word + np.uint64(1))
            word ^= lowest
            if i == n:
                return -2
            out[i] = (base + _CTZ[(lowest * _DEBRUIJN) >> _U58]) << low_bits
            i += 1
            base -= 1
    if i != n:
        return -2
    shift = 8 * a
    prev = np.int64(-1)
    for g in range(plane_len):
        word = np.uint64(0)
        if b:
            for j in range(b):
                word |= np.uint64(planes[j * plane_len + g]) << np.uint64(8 * j)
            word = _transpose8(word)
        for t in range(min(8, n - 8 * g)):
            i = 8 * g + t
            x = out[i] | (np.int64((word >> np.uint64(8 * t)) & _BYTE) << shift)
            if a:
                x |= _field(lows, i * a, a)
            if x <= prev:
                return i
            out[i] = x + offset
            prev = x
    if n and prev >= size:
        return n
    return -1


@numba.njit(cache=True, nogil=True)
def narrow_bytes(indices: Any, c: int, out: Any) -> None:  # pragma: no cover - compiled
    # the low c bytes of each int64 index, little-endian, into out (n * c bytes):
    # the index field of the wire for a width that is not a machine word
    if c == 3:
        for i in range(indices.shape[0]):
            x = indices[i]
            out[3 * i] = x & 0xFF
            out[3 * i + 1] = (x >> 8) & 0xFF
            out[3 * i + 2] = (x >> 16) & 0xFF
        return
    for i in range(indices.shape[0]):
        x = indices[i]
        for b in range(c):
            out[i * c + b] = (x >> (8 * b)) & 0xFF


@numba.njit(cache=True, nogil=True)
def above_positions(  # pragma: no cover - compiled
    words: Any, mask: Any, tb: Any, offset: int, out: Any
) -> int:
    # the threshold scan and compaction in one pass: positions (plus offset)
    # of the entries whose magnitude bits (sign masked off) reach tb. (This plain
    # loop compiled faster than one that also stops when out is full, which made
    # the selection slower: docs/training.md; callers bound the words by out's
    # length instead)
    n = 0
    for i in range(words.shape[0]):
        if (words[i] & mask) >= tb:
            out[n] = i + offset
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def top_k_of_candidates(  # pragma: no cover - compiled
    words: Any, cand: Any, mask: Any, inf_bits: Any, k: int, out: Any
) -> tuple[Any, int, bool]:
    # the exact top-k among candidate positions (sorted) of the words: their
    # magnitude bits (sign masked off) with +-inf as the largest finite value and
    # NaN as +inf; tb the k-th largest of them (a selection, O(len(cand))); the
    # positions above tb, then the first ones at tb in index order up to k, into
    # out. Returns (tb, how many, whether a candidate was NaN or +-inf)
    m = cand.shape[0]
    vals = np.empty(m, words.dtype)
    nonfinite = False
    for i in range(m):
        b = words[cand[i]] & mask
        if b >= inf_bits:
            nonfinite = True
            b = inf_bits - 1 if b == inf_bits else inf_bits
        vals[i] = b
    tb = np.partition(vals, m - k)[m - k]  # (a partitioned copy: vals stays in order)
    above = 0
    for i in range(m):
        above += vals[i] > tb
    ties = k - above
    n = 0
    for i in range(m):
        v = vals[i]
        if v > tb or (v == tb and ties > 0):
            ties -= v == tb
            out[n] = cand[i]
            n += 1
    return tb, n, nonfinite


#: entries per block of bracket_band's counting loop
BAND_BLOCK = 64


@numba.njit(cache=True, nogil=True)
def bracket_band(  # pragma: no cover - compiled
    mag: Any, t_lo: float, t_hi: float, band: Any
) -> tuple[int, int]:
    # one pass over magnitudes (no NaN): how many lie above t_hi, and those in
    # [t_lo, t_hi] copied into band; returns (above, band count). Blocks of
    # BAND_BLOCK: a branch-free count (vectorises), then the copy only in blocks
    # that hold band entries (a narrow band: few blocks, so the copy is rarely paid)
    m = mag.shape[0]
    full = m - m % BAND_BLOCK
    above = 0
    n = 0
    for b0 in range(0, full, BAND_BLOCK):
        ca = 0
        cb = 0
        for i in range(b0, b0 + BAND_BLOCK):
            v = mag[i]
            ca += v > t_hi
            cb += (v >= t_lo) & (v <= t_hi)
        above += ca
        if cb:
            for i in range(b0, b0 + BAND_BLOCK):
                v = mag[i]
                if (v >= t_lo) & (v <= t_hi):
                    band[n] = v
                    n += 1
    for i in range(full, m):
        v = mag[i]
        if v > t_hi:
            above += 1
        elif v >= t_lo:
            band[n] = v
            n += 1
    return above, n


@numba.njit(cache=True, nogil=True)
def natural9_encode(  # pragma: no cover - compiled
    bits: Any, rand: Any, deterministic: bool, exps: Any, plane: Any
) -> tuple[int, int]:
    # C_nat of float32 bit patterns (sparcml.compress.natural): the biased
    # exponent, plus one with probability mantissa / 2^23 (the top 23 bits of a
    # 31-bit draw below the mantissa; deterministic: iff the mantissa's top bit
    # is set), clipped to 254; then the sign bits packed 8 per byte, first in the
    # lowest bit. Two branch-free loops (the first vectorises; one fused loop with
    # the packing in it is slower: docs/benchmarks.md). Returns the largest exponent
    # before rounding (255: NaN/Inf present) and how many rounded up to 255 or more.
    n = bits.shape[0]
    top = 0
    clipped = 0
    if deterministic:
        for i in range(n):
            x = bits[i]
            e = (x >> 23) & 0xFF
            top = max(top, e)
            e += (x >> 22) & 1
            clipped += (e + 1) >> 8  # e is at most 256
            exps[i] = min(e, 254)
    else:
        for i in range(n):
            x = bits[i]
            e = (x >> 23) & 0xFF
            top = max(top, e)
            e += (((rand[i] >> 8) - (x & 0x7FFFFF)) >> 31) & 1
            clipped += (e + 1) >> 8
            exps[i] = min(e, 254)
    full = n // 8
    for b in range(full):
        acc = 0
        for j in range(8):
            acc |= ((bits[8 * b + j] >> 31) & 1) << j
        plane[b] = acc
    if full < plane.shape[0]:
        acc = 0
        for j in range(n - 8 * full):
            acc |= ((bits[8 * full + j] >> 31) & 1) << j
        plane[full] = acc
    return top, clipped


@numba.njit(cache=True, nogil=True)
def natural9_decode(exps: Any, plane: Any, out: Any) -> None:  # pragma: no cover - compiled
    # the float32 bit patterns of 9-bit natural codes: sign << 31 | exponent << 23
    for i in range(exps.shape[0]):
        sign = (np.int32(plane[i >> 3]) >> (i & 7)) & 1
        out[i] = (sign << 31) | (np.int32(exps[i]) << 23)


@numba.njit(cache=True, nogil=True)
def count_nonzero_bits(words: Any, mask: Any) -> int:  # pragma: no cover - compiled
    # how many entries have magnitude bits (sign masked off): not +0.0 or -0.0
    n = 0
    for i in range(words.shape[0]):
        n += (words[i] & mask) != 0
    return n


@numba.njit(cache=True, nogil=True)
def nonzero_bits_positions(words: Any, mask: Any, out: Any) -> int:  # pragma: no cover
    # the positions of those entries, at most len(out) of them written; returns
    # how many there are
    n = 0
    cap = out.shape[0]
    for i in range(words.shape[0]):
        if (words[i] & mask) != 0:
            if n < cap:
                out[n] = i
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def first_zero_bits(words: Any, mask: Any) -> int:  # pragma: no cover - compiled
    # the first entry whose magnitude bits are all zero (+0.0 or -0.0), or -1
    for i in range(words.shape[0]):
        if (words[i] & mask) == 0:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def drop_zero_pairs(  # pragma: no cover - compiled
    indices: Any, words: Any, mask: Any, out_indices: Any, out_words: Any
) -> int:
    # the pairs whose value is not zero (NaN kept, -0.0 not), in order; returns
    # how many
    n = 0
    for i in range(words.shape[0]):
        w = words[i]
        if (w & mask) != 0:
            out_indices[n] = indices[i]
            out_words[n] = w
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def all_finite_bits(words: Any, exponent: Any) -> bool:  # pragma: no cover - compiled
    # whether no entry has all exponent bits set (Inf or NaN); a reduction without
    # an early exit, which the compiler vectorises (an early exit was 2.4x slower
    # at 2^20 entries)
    bad = 0
    for i in range(words.shape[0]):
        bad |= (words[i] & exponent) == exponent
    return bad == 0
