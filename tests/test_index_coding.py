"""Delta-varint and Elias--Fano index coding of quantized sparse messages: lossless,
smaller, checked."""

from __future__ import annotations

import pytest
import torch

from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.compress import get
from sparcml.compress.base import decode_quantized_stream, encode_quantized_stream
from sparcml.compress.packing import decode_index_deltas, encode_index_deltas
from sparcml.errors import WireFormatError
from sparcml.torch import SparcmlState

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [1, 100, 1 << 16, 1 << 22])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.5, 1.0])
def test_roundtrip_and_length(n: int, density: float) -> None:
    g = torch.Generator().manual_seed(n)
    k = round(density * n)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    buf = encode_index_deltas(idx)
    tail = torch.tensor([7, 200, 1], dtype=torch.uint8)  # values follow in a message
    got, used = decode_index_deltas(torch.cat([buf, tail]), idx.numel())
    assert torch.equal(got, idx) and used == buf.numel()
    if k > 1:
        gaps = torch.diff(idx, prepend=torch.zeros(1, dtype=torch.int64))
        expected = sum(1 + (int(x).bit_length() - 1) // 7 if x else 1 for x in gaps.tolist())
        assert buf.numel() == expected


def test_large_indices_and_known_bytes() -> None:
    idx = torch.tensor([0, 127, 128, (1 << 62) + 5])
    got, _ = decode_index_deltas(encode_index_deltas(idx), 4)
    assert torch.equal(got, idx)
    assert encode_index_deltas(torch.tensor([3, 5, 300])).tolist() == [3, 2, 167, 2]


@pytest.mark.parametrize(
    ("data", "count", "needle"),
    [
        ([5, 0x85], 2, "found"),  # the second varint never ends
        ([5, 0], 2, "strictly increasing"),  # a zero gap
        ([0x80] * 10 + [1], 1, "longer than 9 bytes"),
    ],
)
def test_malformed_varints_are_rejected(data: list[int], count: int, needle: str) -> None:
    with pytest.raises(WireFormatError, match=needle):
        decode_index_deltas(torch.tensor(data, dtype=torch.uint8), count)


def test_quantized_stream_with_delta_indices_is_smaller_and_equal() -> None:
    g = torch.Generator().manual_seed(1)
    n = 1 << 20
    idx = torch.randperm(n, generator=g)[: n // 100].sort().values
    s = SparseStream(idx, torch.randn(idx.numel(), generator=g), n)
    q = get("natural")
    fixed = encode_quantized_stream(s, q, torch.Generator().manual_seed(0))
    delta = encode_quantized_stream(s, q, torch.Generator().manual_seed(0), "delta")
    a = decode_quantized_stream(fixed, q, torch.float32, torch.device("cpu"))
    b = decode_quantized_stream(delta, q, torch.float32, torch.device("cpu"))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    # 3-byte indices (N = 2^20, sec. 5.1's c) against ~1.3 bytes at 1% density
    assert fixed.numel() == 16 + 8 + 3 * idx.numel() + q.expected_nbytes(idx.numel())
    assert delta.numel() < fixed.numel() - 1.5 * idx.numel()
    with pytest.raises(WireFormatError):
        bad = delta.clone()
        bad[-1 - q.expected_nbytes(idx.numel())] ^= 0x80  # break the last varint
        decode_quantized_stream(bad, q, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="index_coding"):
        encode_quantized_stream(s, q, None, "zigzag")


@pytest.mark.parametrize("density", [0.0, 1e-5, 0.001, 0.01, 0.2])
def test_quantized_stream_with_elias_fano_indices_is_smallest_and_equal(density: float) -> None:
    """An Elias--Fano field (header flag 4, its low bits in a word before it) where it
    is smaller than the fixed fields, else the fixed fields: the same stream as the
    other codings decode to, in fewer bytes than both; a corrupt field, a low-bits
    word out of range and a truncated field are refused."""
    g = torch.Generator().manual_seed(2)
    n = 1 << 20
    idx = torch.randperm(n, generator=g)[: round(n * density)].sort().values
    s = SparseStream(idx, torch.randn(idx.numel(), generator=g), n)
    q = get("natural")
    msgs = {
        c: encode_quantized_stream(s, q, torch.Generator().manual_seed(0), c)
        for c in ("fixed", "delta", "elias-fano")
    }
    ref = decode_quantized_stream(msgs["fixed"], q, torch.float32, torch.device("cpu"))
    ef = decode_quantized_stream(msgs["elias-fano"], q, torch.float32, torch.device("cpu"))
    assert torch.equal(ef.indices, ref.indices) and torch.equal(ef.values, ref.values)
    flags = int(msgs["elias-fano"][5])  # (the quantized header's flags byte)
    if idx.numel() < 16:  # too few indices for the bitmap and its word to pay: fixed
        assert flags == 0 and torch.equal(msgs["elias-fano"], msgs["fixed"])
        return
    assert flags == 4
    assert msgs["elias-fano"].numel() < msgs["fixed"].numel()
    if density >= 0.001:
        assert msgs["elias-fano"].numel() < msgs["delta"].numel() < msgs["fixed"].numel()
    from sparcml.compress.base import HEADER_BYTES as QHEADER

    low = QHEADER + 8  # the low bits' word
    bad = msgs["elias-fano"].clone()
    bad[low : low + 8] = torch.tensor([70, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    with pytest.raises(WireFormatError, match="low bits"):
        decode_quantized_stream(bad, q, torch.float32, torch.device("cpu"))
    cpu = torch.device("cpu")
    with pytest.raises(WireFormatError, match="truncated"):
        decode_quantized_stream(msgs["elias-fano"][: low + 12], q, torch.float32, cpu)
    bad = msgs["elias-fano"].clone()
    bad[-1 - q.expected_nbytes(idx.numel())] ^= 0xFF  # the field's last bytes
    bad[-9 - q.expected_nbytes(idx.numel())] ^= 0x5A
    with pytest.raises(WireFormatError):
        decode_quantized_stream(bad, q, torch.float32, torch.device("cpu"))


def test_the_codec_sends_quantized_cpu_messages_with_elias_fano_indices() -> None:
    """``index_coding="auto"`` (and ``"delta"``) on the CPU: Elias--Fano fields in
    quantized messages too; ``"fixed"`` keeps the fixed fields."""
    from sparcml.collectives.codec import StreamCodec

    g = torch.Generator().manual_seed(5)
    n = 1 << 20
    idx = torch.randperm(n, generator=g)[: n // 200].sort().values
    s = SparseStream(idx, torch.randn(idx.numel(), generator=g), n)
    for coding, flags in (("auto", 4), ("delta", 4), ("elias-fano", 4), ("fixed", 0)):
        codec = StreamCodec(get("natural"), "all", index_coding=coding)
        msg = codec.encode(s)
        assert int(msg[5]) == flags, coding
        back = codec.decode(msg, n, torch.float32, torch.device("cpu"))
        assert torch.equal(back.indices, idx)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_allreduce_results_do_not_depend_on_the_index_coding(world: int) -> None:
    n = 50_000

    def fn(comm, coding):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        idx = torch.randperm(n, generator=g)[:500].sort().values
        s = SparseStream(idx, torch.randn(500, generator=g), n)
        before = comm.stats.bytes_sent
        out = sparse_allreduce(
            s,
            comm,
            algorithm="ssar_recursive_double",
            quantizer=get("natural", seed=comm.rank),
            quantize="all",
            index_coding=coding,
        )
        return out.to_dense(), comm.stats.bytes_sent - before

    fixed = run_ranks(world, fn, "fixed")
    delta = run_ranks(world, fn, "delta")
    for (a, bytes_a), (b, bytes_b) in zip(fixed, delta, strict=True):
        assert torch.equal(a, b)
        assert world == 1 or bytes_b < bytes_a


def test_state_checks_the_index_coding() -> None:
    with pytest.raises(ValueError, match="index_coding"):
        SparcmlState("topk+natural", density=0.01, index_coding="zigzag")


@pytest.mark.parametrize("coding", ["fixed", "delta"])
def test_a_quantized_stream_goes_dense_where_that_is_smaller(coding: str) -> None:
    """sec. 5.1's switch with the quantized value size: 9-bit natural values beside
    2-byte indices (N = 10,000) are cheaper dense above 1.125 / 3.125 = 36% density
    (fixed), above 1.125 / 2.125 = 53% with delta-coded indices counted at a byte."""
    from sparcml.compress.base import HEADER_BYTES as QHEADER

    n = 10_000
    q = get("natural")
    g = torch.Generator().manual_seed(3)
    for density, dense in ((0.05, False), (0.30, False), (0.45, coding == "fixed"), (0.8, True)):
        idx = torch.randperm(n, generator=g)[: int(n * density)].sort().values
        s = SparseStream(idx, torch.randn(idx.numel(), generator=g), n)
        msg = encode_quantized_stream(s, q, torch.Generator().manual_seed(0), coding)
        back = decode_quantized_stream(msg, q, torch.float32, torch.device("cpu"))
        assert back.is_dense == dense, density
        # the same vector held dense takes the same form, byte for byte (a split
        # piece of a dense gradient reaches the encoder so)
        held_dense = SparseStream.dense(s.to_dense())
        assert torch.equal(
            encode_quantized_stream(held_dense, q, torch.Generator().manual_seed(0), coding), msg
        )
        if dense:
            assert msg.numel() == QHEADER + q.expected_nbytes(n)
        else:
            assert msg.numel() < QHEADER + q.expected_nbytes(n)
        # the same vector either way: zeros stay zeros, the values are natural's powers of two
        got = back.to_dense()
        off = torch.ones(n, dtype=torch.bool)
        off[idx] = False
        assert (got[off] == 0).all()
        v, w = got[idx], s.to_dense()[idx]
        assert (torch.sign(v) == torch.sign(w)).all()
        ratio = v / w
        assert ((ratio >= 0.5 - 1e-6) & (ratio <= 2 + 1e-6)).all()
