"""The pipelined split allgather (chunks of every range, interleaved; beyond the
paper) and the inbox that lets several messages from one rank be in flight.

In-process ranks with the pipelining threshold lowered so that small vectors are
cut into chunks (the default engages from 2^20 indices per range); spawned gloo
ranks with the default threshold, messages past the eager size included. Integer
values make every sum exact: the comparison with the dense reference is exact.
"""

from __future__ import annotations

import pytest
import torch

import gloo_workers
import sparcml.collectives.ssar_split_allgather as split_allgather
from inputs import PATTERNS, dense_reference, make_stream
from sparcml import SparseStream, sparse_allreduce
from sparcml.collectives._common import Inbox
from sparcml.comm import run_ranks
from sparcml.comm.launch import run_processes
from sparcml.errors import RankMismatchError
from sparcml.wire import decode


@pytest.fixture
def pipelined_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pipeline from one index per range; counts the pipelined calls (per rank)."""
    monkeypatch.setattr(split_allgather, "PIPELINE_MIN_WIDTH", 1)
    calls: list[int] = []
    inner = split_allgather.pipelined

    def counted(stream, comm, codec, chunks):  # type: ignore[no-untyped-def]
        calls.append(chunks)
        return inner(stream, comm, codec, chunks)

    monkeypatch.setattr(split_allgather, "pipelined", counted)
    return calls


@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("algorithm", ["ssar_split_allgather", "auto"])
def test_pipelined_is_exact_identical_on_every_rank_and_equal_to_unpipelined(
    world: int, algorithm: str, pipelined_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for size in (1, world, 97, 1000):
        for pattern in PATTERNS:
            for dtype in (torch.float32, torch.bfloat16):

                def fn(comm, pattern=pattern, size=size, dtype=dtype):  # type: ignore[no-untyped-def]
                    s = make_stream(pattern, comm.rank, world, size, dtype)
                    return s, sparse_allreduce(s, comm, algorithm=algorithm)

                before = len(pipelined_calls)
                out = run_ranks(world, fn)
                inputs, results = [o[0] for o in out], [o[1] for o in out]
                if algorithm == "ssar_split_allgather" and size >= world:
                    assert len(pipelined_calls) - before == world, (size, pattern)
                ref = dense_reference(inputs)
                for r, res in enumerate(results):
                    assert res.equal(results[0]), (size, pattern, dtype, r)
                got = results[0].to_dense()
                assert torch.equal(got.to(torch.float64), ref), (size, pattern, dtype)
                # the same values as one chunk per range (the form may differ: the
                # dense switch is taken per chunk)
                with monkeypatch.context() as m:
                    m.setattr(split_allgather, "PIPELINE_MIN_WIDTH", 1 << 62)
                    plain = run_ranks(world, fn)[0][1]
                assert torch.equal(plain.to_dense(), got), (size, pattern, dtype)


def test_pipelined_strided_one_element_and_empty_inputs(pipelined_calls: list[int]) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        base = torch.arange(40, dtype=torch.float32) * (comm.rank + 1)
        strided = SparseStream.dense(base[::2])  # a view with stride 2
        one = SparseStream(torch.tensor([comm.rank % 2]), torch.ones(1), 2)
        empty = SparseStream.empty(10)
        return [sparse_allreduce(s, comm, "ssar_split_allgather") for s in (strided, one, empty)]

    out = run_ranks(3, fn)
    want = [torch.arange(0, 40, 2, dtype=torch.float32) * 6, torch.tensor([2.0, 1.0]), None]
    for r in range(3):
        for got, ref in zip(out[r][:2], want[:2], strict=True):
            assert torch.equal(got.to_dense(), ref)
        assert out[r][2].nnz == 0 and out[r][2].size == 10
    assert pipelined_calls and all(c == split_allgather.PIPELINE_CHUNKS for c in pipelined_calls)


@pytest.mark.parametrize("odd_size", [57, 63])
def test_a_mismatch_fails_every_rank_and_leaves_no_message_behind(
    odd_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2's N differs, so it cuts its ranges into another number of chunks
    (57 // 3 = 19 < 20: one chunk; 63 // 3 = 21: two, as the others' 60 // 3).
    Every rank raises the mismatch, and the next call on the same ranks is right:
    nothing of the failed call was left in flight."""
    monkeypatch.setattr(split_allgather, "PIPELINE_MIN_WIDTH", 20)

    def fn(comm):  # type: ignore[no-untyped-def]
        n = odd_size if comm.rank == 2 else 60
        try:
            sparse_allreduce(SparseStream.empty(n), comm, "ssar_split_allgather")
            first = "no error"
        except RankMismatchError as e:
            first = str(e)
        s = SparseStream(torch.tensor([comm.rank, 59]), torch.ones(2), 60)
        return first, sparse_allreduce(s, comm, "ssar_split_allgather").to_dense()

    out = run_ranks(3, fn, timeout=20)
    want = torch.zeros(60)
    want[[0, 1, 2]] = 1.0
    want[59] = 3.0
    for first, second in out:
        assert f"N={odd_size}" in first, first
        assert torch.equal(second, want)


def test_the_inbox_takes_each_sources_messages_in_order() -> None:
    sizes = [5, 0, 300, 1, 70]

    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank != 0:
            for i, n in enumerate(sizes):
                comm.send(torch.full((n,), 10 * comm.rank + i, dtype=torch.uint8), 0)
            return None
        inbox = Inbox(comm)
        got = {(src, i): inbox.expect(src) for i in range(len(sizes)) for src in (1, 2)}
        # waited out of order: the later receipts take the earlier messages first
        return {key: got[key].wait() for key in sorted(got, reverse=True)}

    out = run_ranks(3, fn)[0]
    for (src, i), msg in out.items():
        assert torch.equal(msg, torch.full((sizes[i],), 10 * src + i, dtype=torch.uint8))


@pytest.mark.spawn
def test_inbox_and_pipelined_call_over_gloo() -> None:
    """Messages past the eager size (a length first, then the body) several at a
    time from one rank, and a pipelined call at the default threshold."""
    out = run_processes(3, gloo_workers.pipelined, timeout=60)
    sizes = gloo_workers.INBOX_SIZES
    for rank, (messages, _, result) in enumerate(out):
        if rank == 0:
            for i, msg in enumerate(messages):
                src, j = divmod(i, len(sizes))
                fill = [10 * (src + 1) + j] if sizes[j] else []
                assert msg == (sizes[j], fill), (i, msg)
        assert torch.equal(result, out[0][2]), rank
    ref = dense_reference([decode(o[1]) for o in out])
    assert torch.equal(decode(out[0][2]).to_dense().to(torch.float64), ref)
