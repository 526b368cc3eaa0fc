"""In-process communicator: point-to-point, irregular collectives, failures and timeouts."""

from __future__ import annotations

import os
import platform
import time

import pytest
import torch

from sparcml.comm import SelfCommunicator, run_ranks
from sparcml.errors import CommTimeoutError


def _bytes(n: int, fill: int) -> torch.Tensor:
    return torch.full((n,), fill % 256, dtype=torch.uint8)


def test_run_ranks_returns_in_rank_order() -> None:
    assert run_ranks(5, lambda comm: (comm.rank, comm.world_size)) == [(r, 5) for r in range(5)]


def test_point_to_point_unknown_sizes_including_zero() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 0:
            comm.send(_bytes(0, 0), 1)
            h = comm.isend(_bytes(1000, 7), 1)
            h.wait()
            return None
        a = comm.recv(0)
        b = comm.irecv(0).wait()
        return a.numel(), b.numel(), int(b[0])

    assert run_ranks(2, fn)[1] == (0, 1000, 7)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_alltoallv_with_zero_size_parts(world: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        # rank r sends (r + j) % 3 bytes of value r*16+j to rank j: some parts are empty
        parts = [_bytes((comm.rank + j) % 3, comm.rank * 16 + j) for j in range(world)]
        got = comm.alltoallv(parts)
        return [(g.numel(), g.tolist()) for g in got]

    out = run_ranks(world, fn)
    for me in range(world):
        for j in range(world):
            n = (j + me) % 3
            assert out[me][j] == (n, [(j * 16 + me) % 256] * n)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_allgatherv_and_stats(world: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        got = comm.allgatherv(_bytes(comm.rank * 3, comm.rank))
        return [g.tolist() for g in got], comm.stats.snapshot()

    out = run_ranks(world, fn)
    expect = [[r] * (r * 3) for r in range(world)]
    total = sum(len(e) for e in expect)
    for me, (got, stats) in enumerate(out):
        assert got == [[x % 256 for x in e] for e in expect]
        # ring: every rank receives every other rank's bytes exactly once
        assert stats.bytes_recv == total - me * 3
    assert sum(s.bytes_sent for _, s in out) == sum(s.bytes_recv for _, s in out)


@pytest.mark.parametrize("world", [1, 2, 3, 6])
@pytest.mark.parametrize("n", [0, 1, 5, 1001])
def test_dense_allreduce_is_exact_and_identical(world: int, n: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(n, generator=g)
        return x, comm.allreduce(x), comm.allreduce(x, op="max")

    out = run_ranks(world, fn)
    ref = torch.stack([o[0] for o in out]).sum(0)
    mx = torch.stack([o[0] for o in out]).amax(0) if n else torch.empty(0)
    for _, s, m in out:
        assert torch.allclose(s, ref, atol=1e-5)
        assert torch.equal(s, out[0][1])
        assert torch.equal(m, mx)


def test_allgather_rejects_shape_mismatch() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        return comm.allgather(torch.zeros(2 + comm.rank))

    with pytest.raises(ValueError, match="shapes differ"):
        run_ranks(2, fn)


def test_exception_on_one_rank_is_raised_and_others_do_not_hang() -> None:
    """The waiting ranks are aborted (RankAbortedError), not left to their timeout
    (which would raise CommTimeoutError): the abort, not a clock, ends them."""
    ended: dict[int, str] = {}

    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 2:
            raise KeyError("boom on rank 2")
        try:
            comm.recv((comm.rank + 1) % comm.world_size)  # would wait forever
        except BaseException as e:
            ended[comm.rank] = type(e).__name__
            raise

    with pytest.raises(KeyError, match="boom") as info:
        run_ranks(4, fn, timeout=600)
    assert any("rank 2" in n for n in info.value.__notes__)
    assert ended == {0: "RankAbortedError", 1: "RankAbortedError", 3: "RankAbortedError"}


def test_missing_rank_times_out_with_its_name() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 0:
            return comm.recv(1)
        return None  # rank 1 never sends

    with pytest.raises(CommTimeoutError, match="rank 1") as info:
        run_ranks(2, fn, timeout=0.3)
    assert info.value.peer == 1


def test_invalid_peer_and_payload() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        with pytest.raises(ValueError, match="invalid destination rank 5"):
            comm.send(_bytes(1, 0), 5)
        with pytest.raises(TypeError, match="uint8"):
            comm.send(torch.zeros(2), 1 - comm.rank)
        return True

    assert run_ranks(2, fn) == [True, True]


def test_self_communicator() -> None:
    comm = SelfCommunicator()
    x = torch.arange(4.0)
    assert torch.equal(comm.allreduce(x), x)
    assert [t.tolist() for t in comm.allgatherv(_bytes(2, 1))] == [[1, 1]]
    assert comm.alltoallv([_bytes(3, 2)])[0].numel() == 3
    comm.barrier()


def test_enable_huge_pages_respects_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's allocator setting: set when absent, a user's 0 kept (and reported off)."""
    from sparcml.comm import enable_huge_pages
    from sparcml.comm.hostmem import VARIABLE

    monkeypatch.delenv(VARIABLE, raising=False)
    assert enable_huge_pages() and os.environ[VARIABLE] == "1"
    monkeypatch.setenv(VARIABLE, "0")
    assert not enable_huge_pages() and os.environ[VARIABLE] == "0"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_keep_freed_memory_respects_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set when absent; a user's own allocator settings, and SPARCML_MALLOC=system, kept."""
    from sparcml.comm import keep_freed_memory
    from sparcml.comm.hostmem import MALLOC_VARIABLES, OPT_OUT

    for key in MALLOC_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the user's own
    assert not keep_freed_memory() and not any(k in os.environ for k in MALLOC_VARIABLES)
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv(OPT_OUT, "system")
    assert not keep_freed_memory() and not any(k in os.environ for k in MALLOC_VARIABLES)
    monkeypatch.delenv(OPT_OUT)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")  # the user's own
    assert not keep_freed_memory() and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert keep_freed_memory()
    assert {k: int(os.environ[k]) for k in MALLOC_VARIABLES} == MALLOC_VARIABLES
    assert not keep_freed_memory()  # (a process started with them has them)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_keep_freed_memory_leaves_glibc_alone_where_it_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A glibc before 2.35 refuses an mmap threshold above 32 MiB: nothing is set (the
    trim threshold alone would switch glibc's adaptive threshold off), said once."""
    import logging

    import sparcml.comm.hostmem as hostmem

    for key in [*hostmem.MALLOC_VARIABLES, "GLIBC_TUNABLES", hostmem.OPT_OUT]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hostmem, "_refused", False)
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 0

    class Libc:
        def __init__(self) -> None:
            self.mallopt = mallopt

    monkeypatch.setattr(hostmem.ctypes, "CDLL", lambda name: Libc())
    with caplog.at_level(logging.WARNING, logger="sparcml.comm.hostmem"):
        assert not hostmem.keep_freed_memory()
        assert not hostmem.keep_freed_memory()
    assert calls == [(-3, 256 << 20)]  # the mmap threshold only, and once
    assert not any(k in os.environ for k in hostmem.MALLOC_VARIABLES)
    assert caplog.text.count("refuses MALLOC_MMAP_THRESHOLD_") == 1


FAULTS = """
import resource, torch
from sparcml.comm import keep_freed_memory
keep_freed_memory()
def rounds(n):
    for _ in range(n):
        held = [torch.ones(m << 18) for m in (1, 3, 9, 27, 2, 6, 18, 40)]  # m MiB each
        del held
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_freed_memory_kept_is_reused_without_page_faults() -> None:
    """Tensors of 1-40 MiB allocated and freed again and again: with glibc's defaults
    their pages are given back and faulted in anew (hundreds of thousands of faults
    here), with :func:`keep_freed_memory` applied in the process they are reused."""
    import subprocess
    import sys

    from sparcml.comm.hostmem import MALLOC_VARIABLES, OPT_OUT

    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES}
    env.pop(OPT_OUT, None)
    env["THP_MEM_ALLOC_ENABLE"] = "0"  # 4 KiB pages: the count does not hang on THP
    faults = {}
    for mode in ("system", "keep"):
        run_env = {**env, OPT_OUT: mode} if mode == "system" else env
        out = subprocess.run([sys.executable, "-c", FAULTS], env=run_env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        faults[mode] = int(out.stdout.split()[-1])
    # 20 rounds of 106 MiB: 542,720 pages if each is faulted in again
    assert faults["system"] > 10_000 and faults["keep"] < 1_000, faults


@pytest.mark.parametrize("world", [1, 3, 8])
def test_ranks_taking_turns_compute_one_at_a_time_and_get_the_same_results(world: int) -> None:
    """``take_turns``: a rank computes only while no other does (what bench-local's
    "alone" column relies on); it hands the CPU on only while waiting for a message."""
    import threading

    guard = threading.Lock()
    state = {"active": 0, "most": 0}

    def enter() -> None:
        with guard:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])

    def leave() -> None:
        with guard:
            state["active"] -= 1

    def fn(comm):  # type: ignore[no-untyped-def]
        total = comm.rank
        for step in range(4):
            enter()
            time.sleep(0.005)  # work that lets go of the GIL: ranks overlap unless taking turns
            total = (total * 3 + step) % 251
            leave()
            right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
            if comm.world_size > 1:
                h = comm.isend(_bytes(1, total), right)
                total += int(comm.recv(left)[0])
                h.wait()
        return total

    free = run_ranks(world, fn)
    assert (state["most"] > 1) == (world > 1)  # the count sees ranks that overlap
    state["most"] = 0
    assert run_ranks(world, fn, take_turns=True) == free
    assert state["most"] == 1


def test_work_futures_complete_whether_asked_for_before_or_after_the_result() -> None:
    from sparcml.comm.engine import Work

    early = Work()
    fut = early.get_future()
    early._finish(torch.ones(2))
    assert fut.wait().tolist() == [1.0, 1.0]
    late = Work()
    late._finish(None, KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        late.get_future().wait()


def test_the_generic_ring_refuses_a_chunk_of_another_size() -> None:
    """The generic ring allreduce (MPI, in-process, simulated ranks) reduced whatever
    chunk came: a rank with a longer tensor had its extra values broadcast into its
    neighbour's sum without a word. The receiving ranks now raise
    ``RankMismatchError``; a rank whose neighbours both sent the right sizes fails
    by its timeout (the error is not agreed in this raw collective)."""
    from sparcml.errors import CommError, RankMismatchError

    def fn(comm):  # type: ignore[no-untyped-def]
        try:
            comm.allreduce(torch.ones(12 if comm.rank == 1 else 10))
        except RankMismatchError as e:
            return "mismatch: " + str(e)
        except CommError as e:
            return type(e).__name__
        return "ok"

    out = run_ranks(3, fn, timeout=2.0)
    assert out[1].startswith("mismatch") and out[2].startswith("mismatch")
    assert "differ in size or dtype" in out[1] and out[0] != "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exchanges_in_either_order_give_the_same_bits(world: int) -> None:
    """``receives_first`` (gloo's order) or the send first (NCCL's): sendrecv, the
    all-to-all, the allgather ring and the dense ring give every rank the same
    exact results either way."""

    def fn(comm, first):  # type: ignore[no-untyped-def]
        comm.receives_first = first
        g = torch.Generator().manual_seed(comm.rank)
        parts = [torch.randint(0, 255, (97 * j,), dtype=torch.uint8, generator=g) for j in
                 range(comm.world_size)]  # fmt: skip
        peer = comm.rank ^ 1
        swapped = comm.sendrecv(parts[0], peer).tolist() if peer < comm.world_size else None
        x = torch.randn(1001, generator=g, dtype=torch.float64)
        return (
            swapped,
            [t.tolist() for t in comm.alltoallv(parts)],
            [t.tolist() for t in comm.allgatherv(parts[-1])],
            comm.allreduce(x).tolist(),
        )

    a = run_ranks(world, lambda comm: fn(comm, True))
    b = run_ranks(world, lambda comm: fn(comm, False))
    assert a == b
    assert all(r[3] == a[0][3] for r in a)  # the same sum on every rank


def test_the_store_host_waits_for_marks_of_this_failure_not_an_earlier_one() -> None:
    """The store's host lingers until the other survivors have read the record of
    *this* failure: a mark a survivor left at an earlier failure (an error every rank
    raised alike) once let it leave at once, and a survivor slower to see a later
    death found the store gone and blamed the host (a flaky fault test under load)."""
    import torch.distributed as dist

    from sparcml.comm.faults import FailureRecord, StoreFaults
    from sparcml.comm.launch import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    faults = StoreFaults(lambda: store, "t", 0, 3, grace=0.1, store_host=0, linger=0.6)
    died = FailureRecord(2, "died", 0, "closed its connection")
    faults.acknowledge(1, call=0)  # rank 0's own mark of the earlier failure
    store.set("t/seen/1", "call 0")  # rank 1's, of that earlier failure
    t0 = time.monotonic()
    faults._wait_for_readers(died, 3)
    assert time.monotonic() - t0 >= 0.5  # the stale mark did not count: it lingered
    store.set("t/seen/1", "call 3")  # rank 1 has read the record of call 3
    t0 = time.monotonic()
    faults._wait_for_readers(died, 3)
    assert time.monotonic() - t0 < 0.3
