"""The same checks over the real transport: spawned processes with gloo on loopback."""

from __future__ import annotations

import os

import pytest
import torch

import gloo_workers
from inputs import dense_reference
from sparcml import algorithms
from sparcml.comm.launch import run_processes
from sparcml.wire import decode

pytestmark = pytest.mark.spawn


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_algorithm_over_gloo(world: int) -> None:
    out = run_processes(world, gloo_workers.reduce_every_algorithm, timeout=60)
    n_cases = len(out[0])
    assert n_cases == len(gloo_workers.CASES) * (len(algorithms(exact=True, variants=False)) + 1)
    for i in range(n_cases):
        size, pattern, algo = out[0][i][:3]
        inputs = [decode(o[i][3]) for o in out]
        ref = dense_reference(inputs)
        for r in range(world):
            # bitwise identical on every rank: the encoded results are the same bytes
            assert torch.equal(out[r][i][4], out[0][i][4]), (size, pattern, algo, r)
        got = decode(out[0][i][4]).to_dense().to(torch.float64)
        assert torch.equal(got, ref), (size, pattern, algo)


def test_outstanding_async_over_gloo() -> None:
    inputs, results = zip(*run_processes(3, gloo_workers.outstanding_async), strict=True)
    for i in range(4):
        ref = dense_reference([decode(x[i]) for x in inputs])
        for r in range(3):
            assert torch.equal(results[r][i], results[0][i])
        assert torch.equal(decode(results[0][i]).to_dense().double(), ref)


def test_mismatched_size_over_gloo() -> None:
    msgs = run_processes(3, gloo_workers.mismatched_size, timeout=30)
    assert all("rank 2: N=49" in m for m in msgs), msgs


def test_dead_rank_is_named() -> None:
    out = run_processes(4, gloo_workers.dead_rank, 1, timeout=10, deadline=60, allow_missing=True)
    assert out[1] is None
    for r in (0, 2, 3):
        name, peer, msg = out[r]
        assert name in {"PeerFailedError", "CommTimeoutError"}, out[r]
        assert peer == 1 and "rank 1" in msg


def test_absent_rank_times_out_with_its_name() -> None:
    out = run_processes(3, gloo_workers.absent_rank, 2, 6.0, timeout=2, deadline=60)
    for r in (0, 1):
        # the absent rank returns without joining: a survivor that waited for it
        # instead of timing out would never return (the run's deadline fails it)
        name, peer, _ = out[r]
        assert (name, peer) in {("CommTimeoutError", 2), ("PeerFailedError", 2)}, out[r]


def test_subgroup_dedicated_group_and_default_communicator() -> None:
    out = run_processes(4, gloo_workers.groups_and_default, timeout=30)
    inputs = [decode(o["input"]) for o in out]
    ref_all = dense_reference(inputs)
    ref_sub = dense_reference(inputs[1:])
    for o in out:
        assert torch.equal(decode(o["default"]).to_dense().double(), ref_all)
        assert torch.equal(decode(o["dedicated"]).to_dense().double(), ref_all)
    for o in out[1:]:
        assert torch.equal(o["sub"], out[1]["sub"])
        assert torch.equal(decode(o["sub"]).to_dense().double(), ref_sub)
    assert "sub" not in out[0]


@pytest.mark.parametrize("world", [3, 4])
def test_topk_family_over_gloo(world: int) -> None:
    from test_oktopk import _gtopk_reference, _local_topk, _oktopk_reference

    out = run_processes(world, gloo_workers.topk_family, timeout=60)
    accs = [o["acc"] for o in out]
    for key in ("oktopk", "gtopk", "topka"):
        assert all(torch.equal(o[key], out[0][key]) for o in out), key
    ref, kept_local = _oktopk_reference(accs, 40)
    got = decode(out[0]["oktopk"]).to_dense().double()
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6) and torch.equal(got != 0, ref != 0)
    assert [set(o["local_indices"].tolist()) for o in out] == kept_local
    locals_ = [_local_topk(a, 40) for a in accs]
    assert decode(out[0]["gtopk"]).equal(_gtopk_reference(locals_, 40))
    topka = decode(out[0]["topka"]).to_dense().double()
    assert torch.allclose(topka, dense_reference(locals_), rtol=1e-6, atol=1e-6)


def test_launcher_reports_the_failing_rank_with_its_traceback() -> None:
    from sparcml.comm.launch import ProcessFailedError

    with pytest.raises(ProcessFailedError, match="rank 1 raised KeyError") as info:
        run_processes(2, gloo_workers.raises_on_rank_one, timeout=20, deadline=60)
    assert info.value.rank == 1 and "deliberate failure" in str(info.value)


def test_messages_of_every_size_around_the_eager_boundary() -> None:
    # one message for payloads up to EAGER_BYTES - 8 bytes, two beyond: sizes on
    # either side of the boundary, empty and large, in a ring, in bursts on one
    # tag and in an alltoallv, arrive whole and in order
    assert run_processes(3, gloo_workers.message_sizes, timeout=60) == [[], [], []]


def test_the_first_message_shrinks_with_the_group() -> None:
    """1 MiB up to P = 9, then ``EAGER_BUDGET / (P - 1)`` in 4 KiB steps, never below
    256 KiB (from P = 33): what a rank's receives post for one message from every
    peer stays within the budget, and both ends of a pair compute the same size."""
    from sparcml.comm.torchdist import EAGER_BUDGET, EAGER_BYTES, EAGER_MAX, eager_bytes

    assert eager_bytes(1) == EAGER_BYTES
    assert [eager_bytes(p) for p in (2, 3, 8, 9)] == [EAGER_MAX] * 4
    assert eager_bytes(10) == 908 * 1024 and eager_bytes(17) == EAGER_BUDGET // 16
    assert eager_bytes(33) == EAGER_BYTES and eager_bytes(4096) == EAGER_BYTES
    for p in range(2, 200):
        e = eager_bytes(p)
        assert e % 4096 == 0 and EAGER_BYTES <= e <= EAGER_MAX
        assert e * (p - 1) <= max(EAGER_BUDGET, EAGER_BYTES * (p - 1))


def test_allgather_direct_and_ring_give_every_piece() -> None:
    # pieces up to DIRECT_ALLGATHER_BYTES travel as one all-to-all, larger ones by
    # gloo's ring all_gather: both give every rank's piece, in rank order, with its
    # dtype and shape, and count (P-1) * bytes per rank
    from sparcml.comm.torchdist import DIRECT_ALLGATHER_BYTES

    out = run_processes(4, gloo_workers.allgather_sizes, timeout=60)
    big = DIRECT_ALLGATHER_BYTES
    for bad, counts in out:
        assert bad == [], bad
        # (bytes counted for the call, all-to-all calls so far)
        assert counts[(0, "torch.uint8")] == (0, 0)
        assert counts[(1, "torch.uint8")] == (3, 1)
        assert counts[(big, "torch.uint8")] == (3 * big, 3)
        assert counts[(big + 1, "torch.uint8")] == (3 * (big + 1), 3)  # the ring
        assert counts[(big // 8 + 1, "torch.float64")][1] == 8  # too large: the ring


def test_dead_rank_in_allgather_is_named() -> None:
    out = run_processes(
        3, gloo_workers.dead_rank_in_allgather, 2, timeout=10, deadline=60, allow_missing=True
    )
    assert out[2] is None
    for r in (0, 1):
        name, peer, msg = out[r]
        assert name in {"PeerFailedError", "CommTimeoutError"}, out[r]
        assert peer == 2 and "rank 2" in msg, out[r]


def test_a_port_taken_after_the_probe_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_port`` only probes; a port another process binds before rank 0 does
    makes the launcher start again on another port instead of failing."""
    import socket

    from sparcml.comm import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real = launch.free_port
    calls: list[int] = []

    def probe() -> int:
        port = next(ports, None) or real()
        calls.append(port)
        return port

    monkeypatch.setattr(launch, "free_port", probe)
    try:
        out = run_processes(2, gloo_workers.rank_and_size, timeout=30)
    finally:
        taken.close()
    assert out == [(0, 2), (1, 2)]
    assert len(calls) == 2 and calls[0] == busy  # the taken port, then another


def test_ranks_get_the_launchers_environment_of_the_launch_from_the_fork_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork server's children would inherit the server's environment, fixed when it
    started; each launch hands its ranks the launcher's own, as spawned ranks had, and
    a launch that changed a variable read at process start spawns its ranks."""
    from sparcml.comm.launch import PRELOAD

    names = ["SPARCML_TEST_LAUNCH_A", "SPARCML_TEST_LAUNCH_B", "THP_MEM_ALLOC_ENABLE"]
    monkeypatch.setenv("SPARCML_TEST_LAUNCH_A", "first")
    monkeypatch.setenv("SPARCML_TEST_LAUNCH_B", "gone later")
    first = run_processes(2, gloo_workers.environment_and_modules, names, timeout=30)
    thp = first[0]["env"][names[2]]
    assert [r["env"] for r in first] == [
        dict(zip(names, ["first", "gone later", thp], strict=True))
    ] * 2
    # the server is running now: later changes must still reach the ranks
    monkeypatch.setenv("SPARCML_TEST_LAUNCH_A", "second")
    monkeypatch.delenv("SPARCML_TEST_LAUNCH_B")
    later = run_processes(2, gloo_workers.environment_and_modules, names, timeout=30)
    assert [r["env"] for r in later] == [{names[0]: "second", names[1]: None, names[2]: thp}] * 2
    # every preloaded module was imported by the server (one that fails is skipped
    # silently there, and each rank would pay for it again)
    assert all(r["preloaded"] == list(PRELOAD) for r in first + later), first[0]["preloaded"]
    # a variable torch reads once per process (huge pages) changed: the server's value
    # would hold in a forked rank, so these ranks are spawned
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0" if thp != "0" else "1")
    changed = run_processes(2, gloo_workers.environment_and_modules, names, timeout=60)
    assert all(r["env"][names[2]] == os.environ["THP_MEM_ALLOC_ENABLE"] for r in changed)
    assert all("sparcml.torch.forkserver" not in r["preloaded"] for r in changed)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", thp)  # back: the server serves again
    again = run_processes(2, gloo_workers.environment_and_modules, names, timeout=30)
    assert all(r["preloaded"] == list(PRELOAD) for r in again)
    spawned = run_processes(
        2, gloo_workers.environment_and_modules, names, timeout=60, start_method="spawn"
    )
    assert [r["env"] for r in spawned] == [r["env"] for r in again]
    assert all("sparcml.torch.forkserver" not in r["preloaded"] for r in spawned)
    with pytest.raises(ValueError, match="start_method"):
        run_processes(2, gloo_workers.rank_and_size, start_method="fork")


def test_a_donated_tensor_is_reduced_in_place_and_nothing_else_is_written() -> None:
    """The dense algorithm hands the backend the fresh vector of a sparse stream (no
    copy of 64 MB per call) and never writes a dense stream's storage."""
    world = 3
    want = sum(torch.arange(6, dtype=torch.float32) + r for r in range(world))
    for row in run_processes(world, gloo_workers.donated_allreduce, timeout=60):
        assert row["same_storage"] and row["dense_untouched"]
        for key in ("plain", "donated", "total", "sparse"):
            assert torch.equal(row[key], want), key


@pytest.mark.spawn
def test_a_length_word_no_message_has_is_a_wire_format_error_naming_the_sender() -> None:
    out = run_processes(2, gloo_workers.absurd_length_word, timeout=20)
    assert out[1] == "sent"
    assert out[0].startswith(
        "WireFormatError: rank 0: rank 1 announced a message of 4,611,686,018,427,387,904 bytes"
    ), out[0]


def test_an_exchange_posts_its_receive_before_its_body() -> None:
    """Both sides of an exchange on one connection post the receive of the other's
    body before sending their own: gloo's rendezvous writes a body into the socket
    ahead of a later "ready to receive" note, and the other direction's body then
    waits for all of it (two 4 MB bodies at 100 Mbit/s: 601.66 against 369.38 ms;
    ``benchmarks/link_burst.py --transport sparcml``)."""
    from sparcml.comm.torchdist import eager_bytes

    EAGER_BYTES = eager_bytes(2)
    body = 2 * EAGER_BYTES - (EAGER_BYTES - 8)  # the worker's message: twice the first
    for per_rank in run_processes(2, gloo_workers.exchange_order, timeout=60):
        for name, log in per_rank.items():
            # the peer's head is received before anything is sent; the own body is
            # sent only once the peer's body has its receive
            assert log[0] == ("recv", EAGER_BYTES), (name, log)
            assert log.index(("recv", body)) < log.index(("send", body)), (name, log)


@pytest.mark.parametrize(
    ("world", "per_node", "algos"),
    [
        # P = 3: recursive doubling's and the sparse allgather's fold (rank 2 sends to
        # rank 0, which answers in the unfold) with bodies over gloo's eager size
        (3, 0, ["ssar_recursive_double", "ssar_split_allgather", "topka", "topkdsa"]),
        # a node's ranks send to their leader, which answers with the node's sum
        (4, 2, ["twolevel_leader"]),
    ],
)
def test_a_message_answered_later_is_not_held_as_an_exchange(
    world: int, per_node: int, algos: list[str]
) -> None:
    """A fold's or a leader's message is answered only after it has arrived: its body
    goes at once (``sendrecv(exchange=False)``). Held as an exchange's, it waited for
    a receive that waited for it, until the timeout."""
    out = run_processes(world, gloo_workers.large_messages, algos, per_node, timeout=30)
    ref = sum(decode(o[0][1]).to_dense().double() for o in out)
    for i, algo in enumerate(algos):
        result = out[0][i][2]
        assert all(torch.equal(o[i][2], result) for o in out), algo  # the same bits everywhere
        assert torch.allclose(decode(result).to_dense().double(), ref, atol=1e-4), algo


def test_an_abort_note_follows_a_held_body() -> None:
    """A body held for an exchange goes before an abort note to the same rank, so
    the note meets the receive it is meant for (gloo matches a pair's messages in
    order) and the peer raises the sender's error at once."""
    out = run_processes(2, gloo_workers.held_body_then_abort, timeout=20, deadline=60)
    whole, kind, message = out[1]
    assert whole, "the held body did not arrive whole before the note"
    assert kind == "PeerFailedError" and "rank 0 raised RuntimeError" in message, out[1]
