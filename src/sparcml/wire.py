"""The wire encoding of sparse streams: one contiguous byte buffer per stream.

Layout (little-endian), 24-byte header then data::

    offset size  field
    0      3     magic b"SpS"
    3      1     format version (3)
    4      1     flags: bit 0 = dense, bit 1 = Elias--Fano index field
    5      1     index width: c, the bytes of a fixed index field (1 to 8, sec. 5.1's
                 ceil(log2(N) / 8)); l, the low bits of an Elias--Fano field; 0 if dense
    6      1     value dtype code (1 float32, 2 float16, 3 bfloat16, 4 float64)
    7      1     reserved, 0
    8      8     N, the vector dimension (uint64)
    16     8     nnz, the number of values that follow (uint64; N if dense)
    24     ..    the index field (sparse only): c*nnz bytes, the low c bytes of each
                 index, or the Elias--Fano field of :mod:`sparcml.indexcode`
    ..     isize*nnz values

A sparse stream costs ``24 + F + nnz * isize`` bytes, where ``F`` is the smaller
index field (:func:`sparcml.indexcode.layout`: ``c * nnz``, or about
``(2 + log2(N / nnz)) / 8`` bytes an index coded Elias--Fano), a dense one
``24 + N * isize``.

:func:`decode` rejects anything that is not such a buffer (wrong magic or
version, unknown dtype, truncated or trailing bytes, indices out of range or not
strictly increasing, an Elias--Fano field holding another count) with a
:class:`~sparcml.errors.WireFormatError`.

Several encoded streams travel together as a *bundle* (:func:`pack` /
:func:`unpack`), used by the recursive-doubling allgather: a header with the
count, then per entry its owner rank and byte length, then the payloads.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence

import torch

from .errors import WireFormatError
from .indexcode import (
    ELIAS_FANO,
    MAX_LOW_BITS,
    elias_fano_nbytes,
    layout,
    read_elias_fano_checked,
    write_elias_fano,
)
from .kernels import compiled
from .reinterpret import as_bytes, bytes_as, dense_1d, indices_from_low_bytes, write_low_bytes
from .stream import SparseStream, index_bytes

__all__ = [
    "HEADER_BYTES",
    "StreamHeader",
    "check_indices",
    "decode",
    "decode_concat",
    "encode",
    "encoded_nbytes",
    "host_bytes",
    "pack",
    "peek",
    "peek_bundle",
    "unpack",
    "widen_checked",
    "widen_increasing",
    "write_index_field",
]

MAGIC = b"SpS"
# 2: c is the fewest bytes that hold N (version 1 rounded it up to 2, 4 or 8);
# 3: the index field may be Elias--Fano coded (flag bit 1)
VERSION = 3
_DENSE, _ELIAS_FANO = 1, 2
_HEADER = struct.Struct("<3sBBBBBQQ")
HEADER_BYTES = _HEADER.size  # 24

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}

_BUNDLE_MAGIC = b"SpB"
_BUNDLE_HEADER = struct.Struct("<3sBI")  # magic, version, count
_BUNDLE_ENTRY = struct.Struct("<iQ")  # owner rank, byte length


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a value dtype."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no wire encoding") from None


def code_dtype(code: int) -> torch.dtype:
    """The value dtype of a wire code."""
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise WireFormatError(f"unknown value dtype code {code}") from None


def _elias_fano_allowed(stream: SparseStream, elias_fano: bool | None) -> bool:
    """``elias_fano`` as given, or (None) for CPU streams only, as ``index_coding="auto"``."""
    return stream.device.type == "cpu" if elias_fano is None else elias_fano


def encoded_nbytes(stream: SparseStream, *, elias_fano: bool | None = None) -> int:
    """Size in bytes of :func:`encode` ``(stream, elias_fano=...)``, without encoding it."""
    isize = stream.values.element_size()
    if stream.is_dense:
        return HEADER_BYTES + stream.size * isize
    field = layout(stream.size, stream.nnz, elias_fano=_elias_fano_allowed(stream, elias_fano))
    return HEADER_BYTES + field.nbytes + stream.nnz * isize


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def encode(stream: SparseStream, *, elias_fano: bool | None = None) -> torch.Tensor:
    """Encode ``stream`` as one contiguous uint8 tensor on the stream's device.

    A sparse stream's indices take the smaller index field
    (:func:`sparcml.indexcode.layout`) where ``elias_fano`` allows it: True on
    every device, False never (sec. 5.1's fixed ``c``-byte fields), None (default)
    for CPU streams only, as ``index_coding="auto"`` does.

    Example:
        >>> s = SparseStream(torch.tensor([3]), torch.tensor([1.5]), 10)
        >>> buf = encode(s); buf.numel()  # 24 + 1-byte index + 4-byte value
        29
        >>> decode(buf).to_dense()[3].item()
        1.5
    """
    device = stream.device
    values = as_bytes(stream.values)
    if stream.is_dense:
        header = _HEADER.pack(
            MAGIC, VERSION, 1, 0, dtype_code(stream.dtype), 0, stream.size, stream.size
        )
        return torch.cat([_bytes_tensor(header, device), values])
    nnz = stream.nnz
    field = layout(stream.size, nnz, elias_fano=_elias_fano_allowed(stream, elias_fano))
    ef = field.coding == ELIAS_FANO
    flags = _ELIAS_FANO if ef else 0
    header = _HEADER.pack(
        MAGIC, VERSION, flags, field.width, dtype_code(stream.dtype), 0, stream.size, nnz
    )
    # one write of each field into the message (the index field starts 8-byte aligned;
    # the values are aligned behind an Elias--Fano field or a word-wide fixed one,
    # else decode copies them once)
    out = torch.empty(
        HEADER_BYTES + field.nbytes + values.numel(), dtype=torch.uint8, device=device
    )
    _write_header(out, header)
    index_field = out[HEADER_BYTES : HEADER_BYTES + field.nbytes]
    if ef:
        write_elias_fano(index_field, stream.indices, stream.size, field.width)
    else:
        write_index_field(index_field, stream.indices, field.width)
    out[HEADER_BYTES + field.nbytes :].copy_(values)
    return out


def _write_header(out: torch.Tensor, header: bytes) -> None:
    """The packed header into the message's first bytes (on the CPU through a numpy
    view: a torch copy of 24 bytes costs several microseconds)."""
    if out.device.type == "cpu":
        out.numpy()[: len(header)] = memoryview(header)
    else:
        out[: len(header)].copy_(_bytes_tensor(header, out.device))


def host_bytes(buf: torch.Tensor, offset: int, n: int) -> bytes:
    """``n`` bytes of a uint8 message from ``offset`` (fewer at its end) as ``bytes``,
    for :mod:`struct`: a copy to the host, on the CPU through a numpy view (a torch
    slice and ``tolist`` cost several microseconds a header)."""
    if buf.device.type == "cpu":
        return buf.numpy()[offset : offset + n].tobytes()
    return bytes(buf[offset : offset + n].tolist())


def _read_header(buf: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireFormatError("a sparse-stream message must be a 1-D uint8 tensor")
    if buf.numel() < HEADER_BYTES:
        raise WireFormatError(
            f"truncated message: {buf.numel()} bytes, the header alone takes {HEADER_BYTES}"
        )
    magic, version, flags, c, code, reserved, size, nnz = _HEADER.unpack(
        host_bytes(buf, 0, HEADER_BYTES)
    )
    if magic != MAGIC:
        raise WireFormatError(f"not a sparse-stream message (magic {magic!r})")
    if version != VERSION:
        raise WireFormatError(f"unsupported wire format version {version} (this is {VERSION})")
    if flags & ~(_DENSE | _ELIAS_FANO) or flags == _DENSE | _ELIAS_FANO or reserved:
        raise WireFormatError(f"malformed header: flags={flags:#x}, reserved={reserved}")
    return flags, c, code, size, nnz, version


def decode(
    buf: torch.Tensor,
    *,
    expect_size: int | None = None,
    expect_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> SparseStream:
    """Decode one :func:`encode` buffer, checking everything.

    Args:
        buf: 1-D uint8 tensor holding exactly one encoded stream.
        expect_size: if given, the stream must have this dimension.
        expect_dtype: if given, the values must have this dtype.
        device: where to place the stream (default: ``buf``'s device).

    Raises:
        WireFormatError: truncated, trailing or corrupt data, or an unexpected
            size/dtype.

    A sparse stream's values are a view into ``buf`` where the alignment allows
    (no copy): do not overwrite ``buf`` while the stream is in use. A dense
    stream gets its own copy (dense streams are summed in place).
    """
    head = _checked_header(buf, expect_size, expect_dtype)
    target = torch.device(device) if device is not None else buf.device
    body = buf[HEADER_BYTES:].to(target)
    if head.dense:
        return SparseStream.dense(body.clone().view(head.dtype))
    indices = torch.empty(head.nnz, dtype=torch.int64, device=target)
    _read_index_field(head, body[: head.field], indices)
    # a view into the message when aligned: sparse streams never write their values
    values = bytes_as(body[head.field :], head.dtype)
    return SparseStream.from_sorted(indices, values, head.size)


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A header checked against its message's length."""

    dense: bool
    ef: bool  # an Elias--Fano index field
    width: int  # c bytes, or l low bits
    dtype: torch.dtype
    size: int
    nnz: int
    field: int  # the index field's bytes


def _read_index_field(
    head: _Checked, raw: torch.Tensor, out: torch.Tensor, offset: int = 0, what: str = "message"
) -> None:
    """The message's indices into ``out`` (plus ``offset``), checked."""
    if not head.ef:
        widen_checked(raw, head.width, head.size, out, offset, what)
        return
    read_elias_fano_checked(raw, head.size, head.width, out, offset, what)


def _checked_header(
    buf: torch.Tensor, expect_size: int | None, expect_dtype: torch.dtype | None
) -> _Checked:
    """The header of a message whose length matches it."""
    flags, width, code, size, nnz, _ = _read_header(buf)
    dtype = code_dtype(code)
    if expect_size is not None and size != expect_size:
        raise WireFormatError(f"message holds a stream of size {size}, expected {expect_size}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise WireFormatError(f"message holds {dtype} values, expected {expect_dtype}")
    isize = dtype.itemsize
    dense, ef = bool(flags & _DENSE), bool(flags & _ELIAS_FANO)
    field = 0
    if dense:
        if width != 0 or nnz != size:
            raise WireFormatError(f"malformed dense header: c={width}, nnz={nnz}, size={size}")
        need = HEADER_BYTES + size * isize
    else:
        if nnz > size:
            raise WireFormatError(f"malformed header: nnz={nnz} exceeds size {size}")
        if size >= 1 << 63:  # sizes and indices are int64 (stream.MAX_SIZE)
            raise WireFormatError(f"malformed header: size {size} exceeds 2^63 - 1")
        if ef:
            if width > MAX_LOW_BITS or not nnz:
                raise WireFormatError(f"malformed Elias-Fano header: l={width}, nnz={nnz}")
            field = elias_fano_nbytes(size, nnz, width)
        else:
            if not 1 <= width <= 8 or width < index_bytes(size):
                raise WireFormatError(
                    f"index width {width} bytes cannot address a stream of size {size}"
                )
            field = nnz * width
        need = HEADER_BYTES + field + nnz * isize
    if buf.numel() != need:
        what = "truncated" if buf.numel() < need else "trailing bytes in"
        raise WireFormatError(f"{what} message: {buf.numel()} bytes, header says {need}")
    return _Checked(dense, ef, width, dtype, size, nnz, field)


def decode_concat(
    bufs: Sequence[torch.Tensor],
    sizes: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    known: Mapping[int, SparseStream] | None = None,
) -> SparseStream | None:
    """Decode messages holding consecutive ranges of one vector into their concatenation.

    What ``SparseStream.concat([decode(b) for b in bufs])`` returns, in one pass
    per message: each message's indices are widened, shifted by its range's start
    and checked straight into the result, its values copied next to them (no
    per-message streams, no second pass to concatenate).

    Args:
        bufs: one :func:`encode` buffer per range, in order.
        sizes: each range's expected size.
        dtype: the values' expected dtype.
        device: where to place the result (default: the first buffer's device).
        known: ranges already held as streams (a rank's own range, whose message it
            sent itself), by position: copied in, their ``bufs`` entries not read.

    Returns:
        The concatenated stream, or ``None`` when a message (or a known stream)
        holds a dense stream (the caller then decodes one by one).

    Raises:
        WireFormatError: as :func:`decode`, naming the message.
    """
    if len(bufs) != len(sizes):
        raise ValueError(f"{len(bufs)} messages for {len(sizes)} ranges")
    known = known or {}
    heads: list[_Checked | SparseStream] = []
    for j, (buf, size) in enumerate(zip(bufs, sizes, strict=True)):
        if j in known:
            part = known[j]
            if part.size != size or part.dtype != dtype:
                raise ValueError(f"range {j}: a known stream of {part} for size {size}, {dtype}")
            if part.is_dense:
                return None
            heads.append(part)
            continue
        try:
            head = _checked_header(buf, size, dtype)
        except WireFormatError as e:
            raise WireFormatError(f"range {j}: {e}") from None
        if head.dense:
            return None
        heads.append(head)
    target = torch.device(device) if device is not None else bufs[0].device
    total = sum(h.nnz for h in heads)
    indices = torch.empty(total, dtype=torch.int64, device=target)
    values = torch.empty(total, dtype=dtype, device=target)
    start = offset = 0
    for j, (buf, size, h) in enumerate(zip(bufs, sizes, heads, strict=True)):
        stop = start + h.nnz
        if isinstance(h, SparseStream):
            torch.add(h.indices.to(target), offset, out=indices[start:stop])
            values[start:stop].copy_(h.values)
        else:
            body = buf[HEADER_BYTES:].to(target)
            _read_index_field(h, body[: h.field], indices[start:stop], offset, f"range {j}")
            # a byte copy: the values need not be aligned in the message (c = 3)
            as_bytes(values[start:stop]).copy_(body[h.field :])
        start = stop
        offset += size
    return SparseStream.from_sorted(indices, values, offset)


def widen_checked(
    raw: torch.Tensor,
    c: int,
    size: int,
    out: torch.Tensor,
    offset: int = 0,
    what: str = "message",
) -> None:
    """The ``c``-byte index fields ``raw`` as int64 into ``out`` (plus ``offset``), checked
    in the same pass: strictly increasing, in ``[0, size)``.

    Raises:
        WireFormatError: naming the first problem.
    """
    words = dense_1d(raw)
    if words.storage_offset() % c:
        words = words.clone()
    stop = widen_increasing(words, c, size, out, offset)
    if stop < 0:
        return
    n = out.numel()
    if stop == n:
        last = int(out[-1]) - offset if n else 0
        raise WireFormatError(f"index {last} in {what} out of range for size {size}")
    if stop == 0:
        first = int(indices_from_low_bytes(raw[:c], c)[0])
        raise WireFormatError(f"negative index {first} in {what}")
    raise WireFormatError(f"indices in {what} are not strictly increasing")


def check_indices(indices: torch.Tensor, size: int, what: str = "message") -> None:
    """What every decoder checks of received indices: in ``[0, size)``, strictly increasing.

    Raises:
        WireFormatError: naming the first problem.
    """
    nnz = indices.numel()
    if not nnz:
        return
    if nnz > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise WireFormatError(f"indices in {what} are not strictly increasing")
    if int(indices[0]) < 0:
        raise WireFormatError(f"negative index {int(indices[0])} in {what}")
    if int(indices[-1]) >= size:
        raise WireFormatError(f"index {int(indices[-1])} in {what} out of range for size {size}")


@dataclasses.dataclass(frozen=True)
class StreamHeader:
    """What an encoded stream's header says (from :func:`peek`, unchecked)."""

    size: int
    nnz: int
    index_width: int  # c bytes per index, or l low bits (Elias--Fano)
    value_bytes: int
    dense: bool
    elias_fano: bool = False

    @property
    def nbytes(self) -> int:
        """The encoded stream's length in bytes, header included."""
        if self.dense:
            return HEADER_BYTES + self.size * self.value_bytes
        if self.elias_fano:
            field = elias_fano_nbytes(self.size, self.nnz, self.index_width)
        else:
            field = self.nnz * self.index_width
        return HEADER_BYTES + field + self.nnz * self.value_bytes


def peek(buf: torch.Tensor, offset: int = 0) -> StreamHeader | None:
    """The header of an encoded stream at ``buf[offset:]``, or None if there is none.

    Lenient (magic and dtype code only, nothing else checked): for tools that
    account for messages, such as the simulator's charge of full-scale bytes.
    Use :func:`decode` to read a stream.
    """
    if buf.numel() - offset < HEADER_BYTES:
        return None
    magic, _v, flags, c, code, _r, size, nnz = _HEADER.unpack(host_bytes(buf, offset, HEADER_BYTES))
    if magic != MAGIC or code not in _CODE_DTYPES:
        return None
    isize = torch.empty((), dtype=_CODE_DTYPES[code]).element_size()
    return StreamHeader(size, nnz, c, isize, bool(flags & _DENSE), bool(flags & _ELIAS_FANO))


def peek_bundle(buf: torch.Tensor) -> list[tuple[int, int]] | None:
    """``(offset, length)`` of each entry of a :func:`pack` bundle, or None if ``buf`` is
    not one (lenient, like :func:`peek`); the table's own bytes end at the first offset."""
    n0 = _BUNDLE_HEADER.size
    if buf.numel() < n0:
        return None
    magic, _v, count = _BUNDLE_HEADER.unpack(host_bytes(buf, 0, n0))
    table_end = n0 + count * _BUNDLE_ENTRY.size
    if magic != _BUNDLE_MAGIC or buf.numel() < table_end:
        return None
    table = host_bytes(buf, n0, table_end - n0)
    out, offset = [], table_end
    for i in range(count):
        _owner, length = _BUNDLE_ENTRY.unpack_from(table, i * _BUNDLE_ENTRY.size)
        out.append((offset, length))
        offset += length
    return out


def pack(entries: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Bundle several ``(owner_rank, encoded_buffer)`` entries into one buffer."""
    if not entries:
        raise ValueError("pack needs at least one entry")
    device = entries[0][1].device
    head = _BUNDLE_HEADER.pack(_BUNDLE_MAGIC, VERSION, len(entries)) + b"".join(
        _BUNDLE_ENTRY.pack(owner, buf.numel()) for owner, buf in entries
    )
    # entries may lie on different devices: this rank's own buffer on the GPU, the
    # ones it received where its transport delivers them (host memory for gloo)
    return torch.cat([_bytes_tensor(head, device), *(buf.to(device) for _, buf in entries)])


def unpack(buf: torch.Tensor, world_size: int) -> list[tuple[int, torch.Tensor]]:
    """Split a :func:`pack` bundle back into ``(owner_rank, encoded_buffer)`` entries.

    Raises:
        WireFormatError: truncated or corrupt bundle, or an owner rank outside
            ``[0, world_size)``.
    """
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireFormatError("a bundle must be a 1-D uint8 tensor")
    n0 = _BUNDLE_HEADER.size
    if buf.numel() < n0:
        raise WireFormatError(f"truncated bundle: {buf.numel()} bytes")
    magic, version, count = _BUNDLE_HEADER.unpack(host_bytes(buf, 0, n0))
    if magic != _BUNDLE_MAGIC or version != VERSION:
        raise WireFormatError(f"not a bundle of this version (magic {magic!r}, version {version})")
    if count == 0 or count > world_size:
        raise WireFormatError(f"bundle claims {count} entries in a world of {world_size}")
    n1 = n0 + count * _BUNDLE_ENTRY.size
    if buf.numel() < n1:
        raise WireFormatError(f"truncated bundle: {buf.numel()} bytes, table needs {n1}")
    table = host_bytes(buf, n0, n1 - n0)
    out: list[tuple[int, torch.Tensor]] = []
    offset = n1
    for i in range(count):
        owner, length = _BUNDLE_ENTRY.unpack_from(table, i * _BUNDLE_ENTRY.size)
        if not 0 <= owner < world_size:
            raise WireFormatError(f"bundle entry names rank {owner}, world size is {world_size}")
        if offset + length > buf.numel():
            raise WireFormatError("truncated bundle: entry runs past the end")
        out.append((owner, buf[offset : offset + length]))
        offset += length
    if offset != buf.numel():
        raise WireFormatError(f"trailing bytes in bundle: {buf.numel() - offset}")
    return out


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
            compiled().widen_increasing(
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
    compiled().narrow_bytes(indices.to(torch.int64).contiguous().numpy(), c, out.numpy())
