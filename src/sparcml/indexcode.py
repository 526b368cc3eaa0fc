"""How a sparse stream's indices travel: fixed ``c``-byte fields or Elias--Fano.

SparCML sends every index of a pair in ``c = ceil(log2(N) / 8)`` bytes (paper
000, sec. 5.1) and leaves the index coding open. The indices of a stream strictly
increase, so at density ``d = n / N`` they carry about ``log2(1/d) + 1.44`` bits
each; three bytes for ``N = 2^24`` spend 24. The library goes beyond the paper
here with the Elias--Fano code (P. Elias 1974, R. Fano 1971), which needs about
``2 + floor(log2(N / n))`` bits per index and decodes without a sequential carry:

1. split every index ``x_i`` into its low ``l = floor(log2(N / n))`` bits and its
   high part ``x_i >> l``;
2. store the low bits as they are: the low ``l // 8`` bytes of each index (the
   fixed field's layout), then ``l % 8`` bit planes of ``ceil(n / 8)`` bytes
   (plane ``j`` holds bit ``8 (l // 8) + j`` of every index);
3. store the high parts as gaps in unary: bit ``(x_i >> l) + i`` of a bitmap of
   ``n + ((N - 1) >> l) + 1`` bits is set (the bitmap holds ``n`` ones; the
   zeros before the ``i``-th one count ``x_i >> l``);
4. pad the field to a multiple of 8 bytes, so the values behind it stay aligned.

Decoding finds the ones of the bitmap (``x_i >> l = position_i - i``) and ORs the
low bits back in. At ``N = 2^24`` and ``d = 0.78%`` (``l = 7``) an index takes
9 bits instead of 24: a float32 pair 5.1 bytes instead of 7; at ``d = 5%``
about 6 bits, at ``d = 0.1%`` about 12.

:func:`layout` chooses per message the smaller of the two codings (ties: the
fixed field), as sec. 5.1's dense switch chooses between pairs and the dense
vector; the cost model (:meth:`sparcml.costmodel.CostModel.message_time`) and the
simulator count the same bytes through :func:`index_field_nbytes`. Varint-coded
gaps (LEB128), the other candidate, measured larger at every density of the
papers' settings (``benchmarks/index_bytes.py``) and decode serially.

The writer and the checked reader run one compiled pass on CPU
(:mod:`sparcml.cpu_kernels`) and torch operations elsewhere (one implementation
per device).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .errors import WireFormatError
from .kernels import compiled
from .reinterpret import (
    dense_1d,
    indices_from_low_bytes,
    pack_bools,
    unpack_bools,
    write_low_bytes,
)
from .stream import index_bytes

__all__ = [
    "ELIAS_FANO",
    "FIXED",
    "IndexLayout",
    "elias_fano_nbytes",
    "index_field_nbytes",
    "layout",
    "read_elias_fano",
    "read_elias_fano_checked",
    "write_elias_fano",
]

FIXED = "fixed"
ELIAS_FANO = "elias-fano"

#: the widest low part: indices are int64, their high parts must stay addressable
MAX_LOW_BITS = 62


@dataclasses.dataclass(frozen=True)
class IndexLayout:
    """A message's index field: its coding, width and size in bytes.

    ``width`` is ``c`` (bytes per index) for :data:`FIXED` and ``l`` (low bits) for
    :data:`ELIAS_FANO`.
    """

    coding: str
    width: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _Parts:
    """Where the pieces of an Elias--Fano field lie (step 2 to 4 of the module doc)."""

    low_bytes: int  # a = l // 8 bytes per index
    planes: int  # b = l % 8 bit planes
    plane_len: int  # ceil(n / 8) bytes each
    nbits: int  # the bitmap's bits: n + ((N - 1) >> l) + 1
    bitmap_at: int  # the bitmap's first byte
    used: int  # bytes before the padding
    nbytes: int  # the field, padded to a multiple of 8

    @classmethod
    def of(cls, size: int, nnz: int, low_bits: int) -> _Parts:
        # (plain ints as the cache's keys: an equal numpy integer would otherwise
        # share the entry and hand its own type back in the fields)
        return _parts(int(size), int(nnz), int(low_bits))


@functools.lru_cache(maxsize=4096)  # (every message asks; a few sizes recur)
def _parts(size: int, nnz: int, low_bits: int) -> _Parts:
    """:meth:`_Parts.of`, cached."""
    a, b = divmod(low_bits, 8)
    plane_len = (nnz + 7) // 8
    nbits = nnz + ((size - 1) >> low_bits) + 1 if size else nnz
    bitmap_at = nnz * a + b * plane_len
    used = bitmap_at + (nbits + 7) // 8
    return _Parts(a, b, plane_len, nbits, bitmap_at, used, (used + 7) // 8 * 8)


def elias_fano_nbytes(size: int, nnz: int, low_bits: int) -> int:
    """Bytes of the Elias--Fano field of ``nnz`` indices below ``size`` with ``l`` low bits."""
    return _Parts.of(size, nnz, low_bits).nbytes


def layout(size: int, nnz: int, *, elias_fano: bool = True) -> IndexLayout:
    """The smaller index field for ``nnz`` strictly increasing indices below ``size``.

    Elias--Fano with ``l = floor(log2(size / nnz))`` (or a neighbour, where the
    planes' rounding makes it smaller) when it takes fewer bytes than the fixed
    ``c``-byte fields, else the fixed fields.

    Example:
        >>> layout(1 << 24, 131072)  # N = 2^24 at d = 0.78%: 9 bits an index
        IndexLayout(coding='elias-fano', width=7, nbytes=147456)
        >>> layout(1 << 24, 10)  # too few indices for the bitmap to pay
        IndexLayout(coding='fixed', width=3, nbytes=30)
    """
    return _layout(int(size), int(nnz), bool(elias_fano))


@functools.lru_cache(maxsize=4096)  # (every message asks; a few sizes recur)
def _layout(size: int, nnz: int, elias_fano: bool) -> IndexLayout:
    """:func:`layout`, cached (plain ints as keys, as :func:`_parts`)."""
    c = index_bytes(size)
    best = IndexLayout(FIXED, c, nnz * c)
    if nnz == 0 or size == 0 or not elias_fano:
        return best
    l0 = max(0, (size // nnz).bit_length() - 1)
    for low_bits in (l0, l0 - 1, l0 + 1):  # l0 first: it wins ties
        # (l0 = floor(log2(size / nnz)), the l of the module doc)
        if 0 <= low_bits <= MAX_LOW_BITS:
            nbytes = elias_fano_nbytes(size, nnz, low_bits)
            if nbytes < best.nbytes:
                best = IndexLayout(ELIAS_FANO, low_bits, nbytes)
    return best


def index_field_nbytes(size: int, nnz: float, *, elias_fano: bool = True) -> int:
    """Bytes of the index field :func:`layout` chooses (``nnz`` rounded; the fixed
    fields alone unless ``elias_fano``): what the cost model and the simulator charge
    for a stream's indices."""
    return layout(size, max(0, round(nnz)), elias_fano=elias_fano).nbytes


def write_elias_fano(out: torch.Tensor, indices: torch.Tensor, size: int, low_bits: int) -> None:
    """Write the Elias--Fano field of ``indices`` (strictly increasing, below ``size``)
    with ``l`` low bits into the uint8 tensor ``out`` of :func:`elias_fano_nbytes` bytes.

    Example:
        >>> out = torch.empty(elias_fano_nbytes(100, 3, 5), dtype=torch.uint8)
        >>> write_elias_fano(out, torch.tensor([3, 40, 99]), 100, 5)
        >>> got = torch.empty(3, dtype=torch.int64)
        >>> read_elias_fano(out, 100, 5, got), got.tolist()
        (-1, [3, 40, 99])
    """
    n = indices.numel()
    parts = _Parts.of(size, n, low_bits)
    if out.numel() != parts.nbytes:
        raise ValueError(f"an Elias-Fano field of {n} indices takes {parts.nbytes} bytes")
    # both writers fill the low bytes and planes; the bitmap's empty words and the
    # padding stay as zeroed here
    if out.device.type == "cpu" and out.is_contiguous():
        # (the pieces as numpy views: a torch slice costs microseconds, a message's
        # field is written in tens)
        field = out.numpy()
        field[parts.bitmap_at :] = 0
        if not n:
            return
        at = n * parts.low_bytes
        compiled().elias_fano_encode(
            dense_1d(indices.to(torch.int64)).numpy(), low_bits, parts.low_bytes,
            parts.planes, parts.plane_len, field[:at], field[at : parts.bitmap_at],
            field[parts.bitmap_at : parts.used],
        )  # fmt: skip
        return
    out[parts.bitmap_at :].zero_()
    if n:
        _write_torch(out, dense_1d(indices.to(torch.int64)), n, low_bits, parts)


def _pieces(field: torch.Tensor, n: int, parts: _Parts) -> tuple[torch.Tensor, ...]:
    """The low bytes, the bit planes and the bitmap of a field."""
    at = n * parts.low_bytes
    return field[:at], field[at : parts.bitmap_at], field[parts.bitmap_at : parts.used]


def _write_torch(
    out: torch.Tensor, idx: torch.Tensor, n: int, low_bits: int, parts: _Parts
) -> None:
    """:func:`write_elias_fano` in torch operations (devices other than the CPU)."""
    a, plane_len = parts.low_bytes, parts.plane_len
    lows, planes, bitmap = _pieces(out, n, parts)
    if a:  # step 2: the low bytes, then the bit planes
        write_low_bytes(lows, idx, a)
    for j in range(parts.planes):
        planes[j * plane_len : (j + 1) * plane_len] = pack_bools((idx >> (8 * a + j)) & 1)
    # step 3: the high parts as unary gaps
    flags = torch.zeros((parts.nbits + 7) // 8 * 8, dtype=torch.uint8, device=out.device)
    flags[(idx >> low_bits) + torch.arange(n, device=out.device)] = 1
    bitmap.copy_(pack_bools(flags))


def read_elias_fano(
    raw: torch.Tensor, size: int, low_bits: int, out: torch.Tensor, offset: int = 0
) -> int:
    """Decode the Elias--Fano field ``raw`` into ``out`` (int64, one per index, plus
    ``offset``), checking in the same pass what :func:`sparcml.wire.decode` checks.

    Returns:
        ``-1`` when ``raw`` holds ``len(out)`` strictly increasing indices below
        ``size`` and zero padding; else where they stop: ``i > 0`` not increasing
        at ``i``, ``len(out)`` the last one ``>= size``, ``-2`` a bitmap holding
        another count of indices (or a set bit past its end, or padding that is
        not zero).

    Raises:
        ValueError: ``raw`` is not the length of such a field.
    """
    n = out.numel()
    parts = _Parts.of(size, n, low_bits)
    if raw.numel() != parts.nbytes:
        raise ValueError(f"an Elias-Fano field of {n} indices takes {parts.nbytes} bytes")
    raw = dense_1d(raw)
    if raw.device.type == "cpu":
        field = raw.numpy()  # (numpy views: see write_elias_fano)
        if field[parts.used :].any():
            return -2
        if not n:
            return -2 if field.any() else -1
        at = n * parts.low_bytes
        return int(
            compiled().elias_fano_decode(
                field[:at], parts.low_bytes, field[at : parts.bitmap_at], parts.planes,
                parts.plane_len, field[parts.bitmap_at : parts.used], parts.nbits,
                low_bits, size, out.numpy(), offset,
            )
        )  # fmt: skip
    if bool(raw[parts.used :].any()):
        return -2
    if not n:
        return -2 if bool(raw.any()) else -1
    return _read_torch(raw, size, low_bits, out, offset, parts)


def read_elias_fano_checked(
    raw: torch.Tensor,
    size: int,
    low_bits: int,
    out: torch.Tensor,
    offset: int = 0,
    what: str = "message",
) -> None:
    """:func:`read_elias_fano`, raising what it finds wrong.

    Raises:
        WireFormatError: naming ``what``: a field that does not hold ``len(out)``
            indices, an index out of range, or indices not strictly increasing.
    """  # fmt: skip
    stop = read_elias_fano(raw, size, low_bits, out, offset)
    if stop == -1:
        return
    if stop == -2:
        raise WireFormatError(
            f"the Elias-Fano index field of {what} does not hold {out.numel()} indices"
        )
    if stop == out.numel():
        last = int(out[-1]) - offset
        raise WireFormatError(f"index {last} in {what} out of range for size {size}")
    raise WireFormatError(f"indices in {what} are not strictly increasing")


def _read_torch(
    raw: torch.Tensor, size: int, low_bits: int, out: torch.Tensor, offset: int, parts: _Parts
) -> int:
    """:func:`read_elias_fano` in torch operations (devices other than the CPU)."""
    n = out.numel()
    a, plane_len = parts.low_bytes, parts.plane_len
    lows, planes, bitmap = _pieces(raw, n, parts)
    ones = torch.nonzero(unpack_bools(bitmap)).reshape(-1)
    if ones.numel() != n or int(ones[-1]) >= parts.nbits:
        return -2
    x = (ones - torch.arange(n, device=raw.device)) << low_bits
    if a:
        x |= indices_from_low_bytes(lows, a)
    for j in range(parts.planes):
        bits = unpack_bools(planes[j * plane_len : (j + 1) * plane_len])[:n]
        x |= bits.to(torch.int64) << (8 * a + j)
    if n > 1:
        bad = torch.nonzero(x[1:] <= x[:-1])
        if bad.numel():
            return int(bad[0]) + 1
    torch.add(x, offset, out=out)
    return n if int(x[-1]) >= size else -1
