"""Elias--Fano index fields (sparcml.indexcode): lossless, smaller, checked, both paths.

The compiled CPU pass and the torch operations (the path of other devices, run
here on CPU tensors) must write the same bytes and read the same indices; every
malformed field is refused with a WireFormatError naming the problem.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inputs import decode_corrupted
from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.costmodel import CostModel
from sparcml.errors import WireFormatError
from sparcml.indexcode import (
    ELIAS_FANO,
    FIXED,
    _Parts,
    _read_torch,
    _write_torch,
    elias_fano_nbytes,
    index_field_nbytes,
    layout,
    read_elias_fano,
    write_elias_fano,
)
from sparcml.stream import index_bytes
from sparcml.wire import HEADER_BYTES, decode, decode_concat, encode, peek

pytestmark = pytest.mark.timeout(120)


def _indices(size: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if size <= 1 << 26:
        return torch.randperm(size, generator=g)[:k].sort().values
    # sizes past memory: distinct indices spread over the whole range, the last one N - 1
    idx = torch.unique(torch.randint(0, size - 1, (k,), generator=g))
    return torch.cat([idx, torch.tensor([size - 1])])[-k:] if k else idx[:0]


def _both_paths(idx: torch.Tensor, size: int, low_bits: int) -> torch.Tensor:
    """The field written by the compiled pass, checked against the torch path's bytes,
    and read back by both."""
    n = idx.numel()
    field = torch.empty(elias_fano_nbytes(size, n, low_bits), dtype=torch.uint8)
    write_elias_fano(field, idx, size, low_bits)
    parts = _Parts.of(size, n, low_bits)
    other = torch.zeros_like(field)
    if n:
        _write_torch(other, idx, n, low_bits, parts)
    assert torch.equal(field, other), "the compiled and the torch writers differ"
    for reader in ("compiled", "torch"):
        out = torch.full((n,), -7, dtype=torch.int64)
        if reader == "compiled":
            stop = read_elias_fano(field, size, low_bits, out, offset=3)
        else:
            stop = _read_torch(field, size, low_bits, out, 3, parts) if n else -1
        assert stop == -1 and torch.equal(out, idx + 3), reader
    return field


@pytest.mark.parametrize(
    ("size", "k"),
    [(1, 1), (2, 1), (8, 8), (100, 3), (1000, 600), (4096, 64), (1 << 20, 8192),
     (1 << 24, 131_072), ((1 << 32) + 5, 300), (1 << 40, 1000), (1 << 62, 17)],
)  # fmt: skip
def test_every_low_width_round_trips_on_both_paths(size: int, k: int) -> None:
    idx = _indices(size, k, seed=size % 997)
    best = layout(size, k)
    widths = {0, 1, 7, 8, 9, 15, 16, 17, best.width, max(0, best.width - 1), best.width + 1}
    for low_bits in sorted(w for w in widths if w < 63 and (size - 1) >> w < 1 << 24):
        _both_paths(idx, size, low_bits)


def test_the_field_takes_two_bits_plus_the_low_bits() -> None:
    # N = 2^24 at d = 0.78% (the setting): l = 7, a bitmap of 2n bits: 9 bits
    n = 131_072
    assert layout(1 << 24, n) == layout(1 << 24, n, elias_fano=True)
    assert layout(1 << 24, n).coding == ELIAS_FANO and layout(1 << 24, n).width == 7
    assert layout(1 << 24, n).nbytes == n * 9 // 8
    # the other densities of the issue: 5% and 0.1%
    for d, bits in ((0.05, 6.3), (0.001, 12.0)):
        k = round(d * (1 << 24))
        assert layout(1 << 24, k).nbytes * 8 / k <= bits
    # fixed when it is smaller (few indices), or when Elias-Fano is not allowed
    assert layout(1 << 24, 10).coding == FIXED
    assert layout(1 << 24, n, elias_fano=False).nbytes == n * index_bytes(1 << 24)
    assert index_field_nbytes(1 << 24, n + 0.4) == layout(1 << 24, n).nbytes


def test_an_empty_or_one_element_stream() -> None:
    assert layout(0, 0).nbytes == 0 and layout(1, 0).nbytes == 0
    for s in (SparseStream.empty(0), SparseStream.empty(10), SparseStream(torch.tensor([0]),
              torch.tensor([2.0]), 1)):  # fmt: skip
        assert decode(encode(s)).equal(s)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 1 << 40),
    st.lists(st.integers(0, (1 << 40) - 1), min_size=0, max_size=300),
)
def test_any_set_of_indices_round_trips(size: int, raw: list[int]) -> None:
    idx = torch.tensor(sorted({x % size for x in raw}), dtype=torch.int64)
    s = SparseStream(idx, torch.arange(idx.numel(), dtype=torch.float32), size)
    buf = encode(s)
    assert decode(buf).equal(s)
    if s.is_dense:  # past sec. 5.1's delta
        return
    want = layout(size, idx.numel())
    assert buf.numel() == HEADER_BYTES + want.nbytes + 4 * idx.numel()
    if want.coding == ELIAS_FANO:
        _both_paths(idx, size, want.width)


def _ef_message() -> tuple[torch.Tensor, SparseStream]:
    idx = _indices(1 << 16, 2000, seed=5)
    s = SparseStream(idx, torch.randn(2000, generator=torch.Generator().manual_seed(1)), 1 << 16)
    buf = encode(s)
    assert buf[4] == 2, "expected an Elias-Fano message"
    return buf, s


def _field(buf: torch.Tensor) -> tuple[int, int, _Parts]:
    h = peek(buf)
    assert h is not None and h.elias_fano
    return h.size, h.index_width, _Parts.of(h.size, h.nnz, h.index_width)


def _refused_on_both_paths(buf: torch.Tensor, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode(buf)
    size, low_bits, parts = _field(buf)
    field = buf[HEADER_BYTES : HEADER_BYTES + parts.nbytes]
    out = torch.empty(peek(buf).nnz, dtype=torch.int64)  # type: ignore[union-attr]
    assert _read_torch(field, size, low_bits, out, 0, parts) != -1


def test_a_bitmap_with_another_count_is_refused() -> None:
    buf, _ = _ef_message()
    _, _, parts = _field(buf)
    at = HEADER_BYTES + parts.bitmap_at
    lost = buf.clone()
    first = int(torch.nonzero(lost[at:]).reshape(-1)[0])
    lost[at + first] = 0  # the indices of a byte dropped
    _refused_on_both_paths(lost, "does not hold 2000 indices")
    extra = buf.clone()
    zero = int(torch.nonzero(extra[at : HEADER_BYTES + parts.used] == 0).reshape(-1)[0])
    extra[at + zero] = 1  # one index too many
    _refused_on_both_paths(extra, "does not hold 2000 indices")


def test_padding_and_bits_past_the_bitmap_are_refused() -> None:
    buf, _ = _ef_message()
    _, _, parts = _field(buf)
    if parts.nbytes > parts.used:
        padded = buf.clone()
        padded[HEADER_BYTES + parts.nbytes - 1] = 0x80
        with pytest.raises(WireFormatError, match="does not hold"):
            decode(padded)
    tail = parts.nbits % 8
    if tail:
        past = buf.clone()
        past[HEADER_BYTES + parts.used - 1] |= 1 << tail
        with pytest.raises(WireFormatError, match="does not hold"):
            decode(past)


def test_repeated_and_out_of_range_indices_are_refused() -> None:
    size, low_bits = 1 << 16, 5  # no low bytes, five bit planes
    idx = torch.tensor([3, 40, 41, 900])
    parts = _Parts.of(size, 4, low_bits)
    good = torch.empty(parts.nbytes, dtype=torch.uint8)
    write_elias_fano(good, idx, size, low_bits)
    # 40 and 41 share their high part and differ in bit 0 only: clear 41's (index 2
    # of plane 0) and it repeats 40
    bad = good.clone()
    bad[0] &= ~(1 << 2)
    out = torch.empty(4, dtype=torch.int64)
    assert read_elias_fano(bad, size, low_bits, out) == 2
    assert _read_torch(bad, size, low_bits, out, 0, parts) == 2
    # an index at N: the same field read for a vector of 900 (the same bitmap length)
    assert _Parts.of(900, 4, low_bits).nbytes == _Parts.of(901, 4, low_bits).nbytes
    assert read_elias_fano(good[: _Parts.of(900, 4, low_bits).nbytes], 900, low_bits, out) == 4
    # through the wire: a message whose header claims one entry less than its last index
    _, s = _ef_message()
    msg = encode(SparseStream(torch.cat([s.indices[:-1], torch.tensor([s.size - 1])]),
                              s.values, s.size))  # fmt: skip
    shrunk = msg.clone()
    shrunk[8:16] = torch.tensor(list((s.size - 1).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(WireFormatError, match="out of range"):
        decode(shrunk)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.binary(min_size=1, max_size=4))
def test_a_corrupted_field_is_refused_or_decodes_to_a_valid_stream(pos: int, junk: bytes) -> None:
    _, s = decode_corrupted(_ef_message()[0], pos, junk)
    if s is None:
        return
    assert decode(encode(s)).equal(s)


def test_decode_concat_mixes_codings_and_names_the_range() -> None:
    sizes = [1 << 16, 50, 1 << 16]
    parts = [
        SparseStream(_indices(n, k, seed=n + k), torch.randn(k), n)
        for n, k in zip(sizes, (3000, 4, 1500), strict=True)
    ]
    bufs = [encode(p) for p in parts]
    assert [int(b[4]) for b in bufs] == [2, 0, 2]  # Elias-Fano, fixed, Elias-Fano
    got = decode_concat(bufs, sizes, torch.float32)
    assert got is not None and got.equal(SparseStream.concat(parts))
    bad = bufs[2].clone()
    _, _, p = _field(bad)
    bad[HEADER_BYTES + p.bitmap_at] ^= 0xFF
    with pytest.raises(WireFormatError, match="range 2"):
        decode_concat([bufs[0], bufs[1], bad], sizes, torch.float32)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("algorithm", ["ssar_recursive_double", "ssar_split_allgather", "auto"])
def test_collectives_give_the_same_bits_with_fewer_bytes(p: int, algorithm: str) -> None:
    """Every index coding gives the same result bits, on every rank; the default one
    sends fewer bytes than the fixed fields at the papers' density."""
    n, k = 1 << 20, 8192  # 0.78%

    def contribution(rank: int) -> SparseStream:
        g = torch.Generator().manual_seed(rank)
        idx = torch.randperm(n, generator=g)[:k]
        return SparseStream(idx, torch.randn(k, generator=g), n)

    def job(comm, coding: str):  # type: ignore[no-untyped-def]
        s = contribution(comm.rank)
        before = comm.stats.bytes_sent
        out = sparse_allreduce(s, comm, algorithm, index_coding=coding)
        return out.to_dense(), comm.stats.bytes_sent - before

    fixed = run_ranks(p, lambda c: job(c, "fixed"))
    auto = run_ranks(p, lambda c: job(c, "auto"))
    dense = sum(contribution(r).to_dense() for r in range(p))
    for (a, _), (b, _) in zip(fixed, auto, strict=True):
        assert torch.equal(a, b) and torch.equal(a, auto[0][0])
    assert torch.allclose(auto[0][0], dense, atol=1e-5)  # float sums in another order
    if p > 1 and algorithm != "auto":
        sent_fixed = sum(b for _, b in fixed)
        sent_auto = sum(b for _, b in auto)
        assert sent_auto < 0.85 * sent_fixed, (sent_auto, sent_fixed)


def test_bad_index_coding_is_named() -> None:
    s = SparseStream(torch.tensor([1]), torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="index_coding must be one of 'fixed', 'delta'"):
        sparse_allreduce(s, None, index_coding="gamma")


def test_the_cost_model_counts_the_coded_bytes() -> None:
    m = CostModel(alpha=0.0, beta=1e-9, gamma=0.0)
    n, k = 1 << 24, 131_072
    t = m.message_time(k, n, 4)
    assert t == pytest.approx(1e-9 * (HEADER_BYTES + k * 9 // 8 + 4 * k))
