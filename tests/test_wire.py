"""Wire encoding: round trips, compactness and rejection of malformed buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inputs import decode_corrupted
from sparcml import SparseStream
from sparcml.errors import WireFormatError
from sparcml.stream import SUPPORTED_DTYPES
from sparcml.wire import (
    HEADER_BYTES,
    decode,
    decode_concat,
    encode,
    encoded_nbytes,
    pack,
    unpack,
)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize(
    ("size", "c"),
    [(0, 1), (1, 1), (7, 1), (256, 1), (257, 2), (65_536, 2), (65_537, 3), (1 << 24, 3),
     ((1 << 24) + 1, 4), ((1 << 32) + 1, 5), ((1 << 48) + 1, 7), ((1 << 56) + 1, 8)],
)  # fmt: skip
def test_roundtrip_sparse(dtype: torch.dtype, size: int, c: int) -> None:
    g = torch.Generator().manual_seed(size % 1000)
    k = min(size, 5)
    idx = torch.randint(0, size, (k,), generator=g) if size else torch.empty(0, dtype=torch.int64)
    idx[-1:] = size - 1  # the widest index the size allows
    s = SparseStream(idx, torch.randn(k, generator=g).to(dtype), size)
    assert decode(encode(s)).equal(s)  # the smaller index field (fixed for so few indices)
    buf = encode(s, elias_fano=False)
    assert buf.dtype == torch.uint8 and buf.numel() == encoded_nbytes(s, elias_fano=False)
    if not s.is_dense:
        # sec. 5.1: c = ceil(log2(N) / 8) bytes per index, values after the indices
        assert buf[5] == c
        assert buf.numel() == HEADER_BYTES + s.nnz * (c + s.values.element_size())
    assert decode(buf).equal(s)
    whole = decode_concat([buf, buf], [size, size], dtype)
    if not s.is_dense:
        assert whole is not None and whole.equal(SparseStream.concat([s, s]))


def test_roundtrip_dense_and_special_values() -> None:
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1.0, 2.0, 3.0])
    s = SparseStream.dense(x)
    buf = encode(s)
    assert buf.numel() == HEADER_BYTES + 6 * 4
    assert decode(buf).equal(s)


def _good() -> torch.Tensor:
    return encode(SparseStream(torch.tensor([1, 5, 9]), torch.tensor([1.0, 2.0, 3.0]), 10))


def _patched(offset: int, value: int) -> torch.Tensor:
    b = _good().clone()
    b[offset] = value
    return b


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (torch.zeros(5, dtype=torch.uint8), "truncated"),
        (_good()[:-1], "truncated"),
        (torch.cat([_good(), torch.zeros(1, dtype=torch.uint8)]), "trailing"),
        (_patched(0, ord("X")), "magic"),
        (_patched(3, 9), "version"),
        (_patched(4, 3), "flags"),  # dense and Elias-Fano
        (_patched(4, 6), "flags"),
        (_patched(5, 0), "index width"),
        (_patched(5, 9), "index width"),
        (_patched(6, 99), "dtype code"),
        (_patched(8, 9), "out of range"),  # N = 9 but the last index is 9
        (_patched(16, 200), "nnz"),
        (_patched(24 + 1, 0), "strictly increasing"),  # second index 5 -> 0 (c = 1)
        (torch.zeros(30, dtype=torch.float32), "uint8"),
    ],
)
def test_malformed_buffers_are_rejected(buf: torch.Tensor, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode(buf)


def test_expectations_are_checked() -> None:
    with pytest.raises(WireFormatError, match="expected 11"):
        decode(_good(), expect_size=11)
    with pytest.raises(WireFormatError, match=r"expected torch\.float64"):
        decode(_good(), expect_dtype=torch.float64)


def test_bundles() -> None:
    a, b = _good(), encode(SparseStream.empty(3))
    out = unpack(pack([(2, a), (0, b)]), world_size=3)
    assert [o for o, _ in out] == [2, 0]
    assert torch.equal(out[0][1], a) and torch.equal(out[1][1], b)
    with pytest.raises(WireFormatError, match="names rank 2"):
        unpack(pack([(2, a)]), world_size=2)
    with pytest.raises(WireFormatError, match=r"truncated|runs past"):
        unpack(pack([(0, a)])[:-3], world_size=2)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=120))
def test_decoder_never_crashes_on_garbage(data: bytes) -> None:
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    try:
        s = decode(buf)
    except WireFormatError:
        return
    if not buf[4] & 2:  # an Elias-Fano field may have been written with another l
        assert encode(s, elias_fano=False).numel() == buf.numel()
    assert decode(encode(s)).equal(s)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.binary(min_size=1, max_size=4))
def test_a_corrupted_buffer_is_rejected_or_decodes_to_a_valid_stream(pos: int, junk: bytes) -> None:
    """Bytes changed in a valid buffer either fail with WireFormatError or still form
    a valid encoding (a changed value, say): then the stream is well formed (indices
    strictly increasing and below its size) and encodes back to exactly those bytes."""
    buf, s = decode_corrupted(_good(), pos, junk)
    if s is None:
        return
    if buf[4] & 2:  # now read as Elias-Fano coded: another l than encode would choose
        assert decode(encode(s)).equal(s)
    else:
        assert torch.equal(encode(s, elias_fano=False), buf)


def test_decode_concat_equals_decoding_then_concatenating() -> None:
    from sparcml.wire import decode_concat

    g = torch.Generator().manual_seed(3)
    sizes = [70_000, 1, 0, 5_000_000_000, 40]
    parts = []
    for n in sizes:
        k = min(n // 8, 50)
        idx = torch.unique(torch.randint(0, max(n, 1), (k,), generator=g))[:k] if n else idx0()
        parts.append(SparseStream(idx, torch.randn(idx.numel(), generator=g), n))
    bufs = [encode(p) for p in parts]
    got = decode_concat(bufs, sizes, torch.float32)
    assert got is not None and got.equal(SparseStream.concat([decode(b) for b in bufs]))
    # a dense range: the caller decodes one by one
    dense = [encode(SparseStream.dense(torch.ones(3))), bufs[0]]
    assert decode_concat(dense, [3, sizes[0]], torch.float32) is None
    # a range of the wrong size, or out-of-order indices, is named
    with pytest.raises(WireFormatError, match="range 1: message holds a stream of size 1"):
        decode_concat(bufs[:2], [sizes[0], 2], torch.float32)
    bad = encode(parts[0], elias_fano=False)
    body = bad[HEADER_BYTES : HEADER_BYTES + 8]
    body[4:8] = body[0:4].clone()  # second index = first
    with pytest.raises(WireFormatError, match="range 0 are not strictly increasing"):
        decode_concat([bad], [sizes[0]], torch.float32)


def test_decode_concat_copies_known_ranges_in_place_of_their_messages() -> None:
    """A rank's own range, held as a stream, is copied in instead of decoded from
    the message it sent (the split allgather's last step): the same result, whatever
    its message holds (here garbage); a dense known range leaves the caller to
    decode one by one; a known range of the wrong size is refused."""
    from sparcml.wire import decode_concat

    g = torch.Generator().manual_seed(4)
    sizes = [1000, 0, 3000, 17]
    parts = []
    for n in sizes:
        idx = torch.randperm(n, generator=g)[: n // 10].sort().values
        parts.append(SparseStream(idx, torch.randn(idx.numel(), generator=g), n))
    bufs = [encode(p) for p in parts]
    want = decode_concat(bufs, sizes, torch.float32)
    assert want is not None
    for j in range(len(sizes)):
        garbage = [b if i != j else torch.zeros(3, dtype=torch.uint8) for i, b in enumerate(bufs)]
        got = decode_concat(garbage, sizes, torch.float32, known={j: parts[j]})
        assert got is not None and got.equal(want), j
    dense = SparseStream.dense(torch.ones(17))
    assert decode_concat(bufs, sizes, torch.float32, known={3: dense}) is None
    with pytest.raises(ValueError, match="range 2: a known stream"):
        decode_concat(bufs, sizes, torch.float32, known={2: parts[0]})


def idx0() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


def test_a_size_past_int64_is_refused_clearly() -> None:
    """An audit found N = 2^63 admitted by the header check (and by the stream's
    constructor): an Elias-Fano message of that size raised OverflowError from the
    compiled decoder instead of WireFormatError; sizes and indices are int64, so the
    largest size is 2^63 - 1, on the wire and in the constructor."""
    import struct

    from sparcml.indexcode import elias_fano_nbytes
    from sparcml.stream import MAX_SIZE

    ordinary = SparseStream(torch.arange(0, 1 << 20, 4096), torch.ones(256), 1 << 20)
    decode(encode(ordinary, elias_fano=True))  # the kernel compiled as a receiver's is
    header = struct.Struct("<3sBBBBBQQ")  # wire._HEADER: magic, version, flags, l, dtype, 0, N, nnz
    for size, refused in ((1 << 63, True), (MAX_SIZE, False)):
        field = bytearray(elias_fano_nbytes(size, 1, 62))
        field[7 + 6] = 1  # the bitmap's first bit, after 7 low bytes and 6 planes
        msg = header.pack(b"SpS", 3, 2, 62, 1, 0, size, 1) + bytes(field) + bytes(4)
        buf = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        if refused:
            with pytest.raises(WireFormatError, match=r"size 9223372036854775808 exceeds"):
                decode(buf)
        else:
            assert decode(buf).size == MAX_SIZE
    assert SparseStream(torch.tensor([MAX_SIZE - 1]), torch.ones(1), MAX_SIZE).nnz == 1
    with pytest.raises(ValueError, match=r"at most 2\^63 - 1"):
        SparseStream(torch.tensor([0]), torch.ones(1), 1 << 63)
