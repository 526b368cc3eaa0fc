"""The aggregator against stale, foreign, spoofed, replayed and flooding packets (issue 18).

Every test checks for *no wrong sum ever*: a sum is either exactly the reference
or the call fails with an error. Deterministic scenarios drive the aggregator's
``handle`` directly (packets in a chosen order, results read from its shadow
copies); end-to-end ones run workers as threads against a served aggregator,
or ranks of ``run_ranks`` through ``SparcmlState("natural_ina")``.
"""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparcml.comm import run_ranks
from sparcml.comm.launch import run_processes
from sparcml.errors import CommTimeoutError
from sparcml.ina import (
    AggregatorServer,
    InaSession,
    InaStats,
    LossyRelay,
    PacketError,
    agree_session,
    ina_allreduce,
    parse,
)
from sparcml.ina.packet import (
    DATA,
    FIXED,
    HEADER,
    RESULT,
    STATS,
    Packet,
    build,
    session_key,
    verify,
)
from sparcml.ina.worker import _result
from sparcml.torch import SparcmlState
from sparcml.torch.reduce import Bucket, reduce_bucket

SINK = ("127.0.0.1", 9)  # results of handle()-driven scenarios go nowhere
SECRET = b"a test secret of the aggregator"


# ---------------------------------------------------------------------- helpers
def _pkt(token: int, worker: int, workers: int, chunk: int, values: list[int],
         key: bytes | None = None) -> bytes:  # fmt: skip
    """A FIXED-mode DATA datagram."""
    payload = np.asarray(values, dtype=">i4").tobytes()
    return build(Packet(DATA, token, 0, worker, workers, chunk, FIXED, len(values), payload), key)


def _sum_of(srv: AggregatorServer, token: int, chunk: int) -> list[int]:
    """The result the aggregator sent for ``chunk`` (its shadow copy)."""
    p = parse(srv.sessions[token].shadows[chunk].out)
    return np.frombuffer(p.payload, dtype=">i8").tolist()


def _ints(world: int, n: int, seed: int, scale: int = 1) -> list[torch.Tensor]:
    """Integer-valued float32 gradients: fixed point and float sums are exact."""
    return [
        torch.randint(
            -50, 50, (n,), generator=torch.Generator().manual_seed(seed * 100 + r)
        ).float()
        * scale
        for r in range(world)
    ]


def _workers(ranks, world, xs, target, mode, session, **kw):  # type: ignore[no-untyped-def]
    """Workers ``ranks`` (threads) of one session; returns (outputs, errors) per rank."""
    outs: list = [None] * world
    errs: list = [None] * world

    def body(r: int) -> None:
        try:
            outs[r] = ina_allreduce(xs[r], target, session, r, world, mode, **kw)
        except Exception as e:
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outs, errs


def _exact(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).double().sum(0).float()


SIZES = (300, 7, 1200)


def _job(comm, server: str, steps: int, seed: int, hyper: dict):  # type: ignore[no-untyped-def]
    """One rank of a job: ``steps`` buckets of integer gradients through natural_ina
    (fixed mode, default ``job``); module level, so spawned ranks can run it too."""
    state = SparcmlState("natural_ina", comm=comm, server=server, mode="fixed", **hyper)
    names = tuple(f"p{i}" for i in range(len(SIZES)))
    grads = [_ints(comm.world_size, sum(SIZES), seed + t)[comm.rank] for t in range(steps)]
    return [reduce_bucket(state, Bucket(names, SIZES, g, t)) for t, g in enumerate(grads)]


def _train(world: int, server: str, steps: int, seed: int, spawn: bool = False, **hyper):  # type: ignore[no-untyped-def]
    """A job of ``world`` ranks (threads, or gloo processes): its averages and the exact ones."""
    if spawn:
        out = run_processes(world, _job, server, steps, seed, hyper, timeout=60)
    else:
        out = run_ranks(world, _job, server, steps, seed, hyper)
    refs = [_exact(_ints(world, sum(SIZES), seed + t)) / world for t in range(steps)]
    return out, refs


# --------------------------------------------------------------- jobs and runs
def test_a_second_run_with_the_same_job_id_never_gets_the_first_runs_results() -> None:
    """Issue 18: run 2 with the default job=1 received run 1's shadows (30 -> 3)."""
    with AggregatorServer() as srv:
        server = f"{srv.address[0]}:{srv.address[1]}"
        for seed in (1, 2):  # two runs, different gradients, the same (default) job id
            out, refs = _train(3, server, steps=3, seed=seed)
            for rank_out in out:
                for got, ref in zip(rank_out, refs, strict=True):
                    assert torch.equal(got, ref)
        assert srv.snapshot()["sessions_created"] == 2


@pytest.mark.parametrize("spawn", [False, pytest.param(True, marks=pytest.mark.spawn)])
def test_two_concurrent_jobs_with_the_same_job_id_do_not_mix(spawn: bool) -> None:
    """Issue 18: two trainings with job=1 on one aggregator mixed their gradients.
    Ranks as threads, and as gloo processes (two jobs of two processes at once)."""
    world = 2 if spawn else 3
    with AggregatorServer() as srv:
        server = f"{srv.address[0]}:{srv.address[1]}"
        res: dict = {}
        jobs = [
            threading.Thread(
                target=lambda s=s: res.update({s: _train(world, server, 4, s, spawn=spawn)})
            )
            for s in (10, 20)
        ]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join(240)
        assert srv.snapshot()["sessions_created"] == 2
    for s in (10, 20):
        out, refs = res[s]
        for rank_out in out:
            for got, ref in zip(rank_out, refs, strict=True):
                assert torch.equal(got, ref)


def test_a_restart_after_a_crash_never_sees_the_dead_runs_partial_sums() -> None:
    """Run 1: worker 2 dies before sending, workers 0 and 1 leave partial sums and time
    out. The restart (a new session, as agree_session makes) must sum only its own."""
    world, n = 3, 1000
    with AggregatorServer() as srv:
        dead = InaSession.create(world, "fixed")
        _, errs = _workers([0, 1], world, _ints(world, n, 1), srv.address, "fixed", dead,
                           timeout=0.5)  # fmt: skip
        assert all(isinstance(errs[r], CommTimeoutError) for r in (0, 1)), errs
        assert srv.snapshot()["slots"] > 0  # the dead run's partial sums are still there
        xs = _ints(world, n, 2)
        outs, errs = _workers(range(world), world, xs, srv.address, "fixed",
                              InaSession.create(world, "fixed"))  # fmt: skip
    assert errs == [None] * world
    for o in outs:
        assert torch.equal(o, _exact(xs))


def test_a_restart_with_another_bucket_layout_is_accepted() -> None:
    """Issue 18: after a long run, a restart with other chunk sizes was `count_mismatch`."""
    with AggregatorServer() as srv:
        for n, chunk in ((1000, 256), (777, 100)):
            xs = _ints(2, n, n)
            outs, errs = _workers(range(2), 2, xs, srv.address, "fixed",
                                  InaSession.create(2, "fixed"), chunk=chunk)  # fmt: skip
            assert errs == [None, None]
            assert all(torch.equal(o, _exact(xs)) for o in outs)
        assert srv.snapshot().get("rejected", 0) == 0


# ------------------------------------------------------------------ spoofing
def test_a_spoofed_datagram_with_a_wrong_token_is_never_aggregated() -> None:
    """Issue 18: one datagram claiming to be worker 1 made a chunk sum 1000 instead of 3."""
    srv = AggregatorServer()
    try:
        s = InaSession.create(3, "fixed")
        srv.handle(_pkt(s.token, 0, 3, 0, [1]), SINK)
        for token in (s.token ^ 1, s.token ^ (1 << 63), random.getrandbits(64) | 1):
            srv.handle(_pkt(token, 1, 3, 0, [998]), SINK)  # wrong token, claims worker 1
        srv.handle(_pkt(s.token, 1, 3, 0, [1]), SINK)
        srv.handle(_pkt(s.token, 2, 3, 0, [1]), SINK)
        assert _sum_of(srv, s.token, 0) == [3]
    finally:
        srv.sock.close()


def test_a_non_member_is_rejected_and_a_rogue_workers_5_packet_locks_nobody_out() -> None:
    srv = AggregatorServer()
    try:
        s = InaSession.create(3, "fixed")
        srv.handle(_pkt(random.getrandbits(64) | 1, 4, 5, 0, [7]), SINK)  # its own session
        srv.handle(_pkt(s.token, 0, 3, 0, [1]), SINK)
        srv.handle(_pkt(s.token, 4, 5, 0, [500]), SINK)  # the right token, not a member
        srv.handle(_pkt(s.token, 1, 5, 0, [500]), SINK)  # a member's id, wrong membership
        srv.handle(_pkt(s.token, 1, 3, 0, [1]), SINK)
        srv.handle(_pkt(s.token, 2, 3, 0, [1]), SINK)
        assert _sum_of(srv, s.token, 0) == [3]
        assert srv.snapshot()["rejected_not_member"] == 2
    finally:
        srv.sock.close()


def test_keyed_sessions_reject_forged_tampered_and_untagged_packets() -> None:
    """MAC mode: even with the right token and a member's id (an on-path attacker), a
    packet without a valid tag never counts."""
    srv = AggregatorServer(secret=SECRET)
    try:
        s = InaSession.create(3, "fixed", SECRET)
        assert s.key == session_key(SECRET, s.token, 3, FIXED)
        srv.handle(_pkt(s.token, 0, 3, 0, [1], s.key), SINK)
        forged = [
            _pkt(s.token, 1, 3, 0, [998]),  # untagged
            _pkt(s.token, 1, 3, 0, [998], bytes(32)),  # tagged under a wrong key
            _pkt(s.token, 1, 3, 0, [998], session_key(b"guess", s.token, 3, FIXED)),
        ]
        good = _pkt(s.token, 1, 3, 0, [1], s.key)
        tampered = bytearray(good)
        tampered[HEADER.size + 3] ^= 0x10  # the value, the tag left as it was
        forged.append(bytes(tampered))
        for f in forged:
            srv.handle(f, SINK)
        srv.handle(good, SINK)
        srv.handle(_pkt(s.token, 2, 3, 0, [1], s.key), SINK)
        assert _sum_of(srv, s.token, 0) == [3]
        counters = srv.snapshot()
        assert counters["rejected_mac_required"] == 1 and counters["rejected_bad_mac"] == 3
        # a session created without the secret is refused too
        srv.handle(_pkt(random.getrandbits(64) | 1, 0, 1, 0, [5]), SINK)
        assert srv.snapshot()["rejected_mac_required"] == 2
        assert srv.snapshot()["sessions"] == 1
    finally:
        srv.sock.close()


def test_workers_accept_only_their_sessions_authentic_results() -> None:
    keyed = InaSession.create(2, "fixed", SECRET)
    plain = InaSession.create(2, "fixed")
    payload = (12).to_bytes(8, "big")
    result = Packet(RESULT, keyed.token, 7, 0, 2, 0, FIXED, 1, payload)
    assert _result(build(result, keyed.key), keyed, 2, FIXED) is not None
    assert _result(build(result), keyed, 2, FIXED) is None  # untagged
    assert _result(build(result, bytes(32)), keyed, 2, FIXED) is None  # forged
    other = Packet(RESULT, plain.token ^ 1, 7, 0, 2, 0, FIXED, 1, payload)
    assert _result(build(other), plain, 2, FIXED) is None  # another session's
    mine = Packet(RESULT, plain.token, 7, 0, 2, 0, FIXED, 1, payload)
    assert _result(build(mine), plain, 2, FIXED) is not None
    assert _result(build(mine), plain, 3, FIXED) is None  # another membership


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 8 * (HEADER.size + 8 + 16) - 1))
def test_no_single_bit_flip_of_a_tagged_packet_verifies(bit: int) -> None:
    s = InaSession.create(2, "fixed", SECRET)
    buf = bytearray(_pkt(s.token, 1, 2, 5, [1, 2], s.key))
    buf[bit // 8] ^= 1 << (bit % 8)
    try:
        parse(bytes(buf))
    except PacketError:
        return
    assert s.key is not None and not verify(bytes(buf), s.key)


# ------------------------------------------------------------------- replays
def test_an_old_sessions_replayed_packets_never_reach_a_new_session() -> None:
    """Run A sums 1+1+1 = 3; its packets replayed during run B (10+10+10) must not count,
    also once A has expired and the replay re-creates it."""
    now = [0.0]
    srv = AggregatorServer(clock=lambda: now[0], session_timeout=10.0)
    try:
        a, b = InaSession.create(3, "fixed"), InaSession.create(3, "fixed")
        old = [_pkt(a.token, w, 3, 0, [1]) for w in range(3)]
        for d in old:
            srv.handle(d, SINK)
        assert _sum_of(srv, a.token, 0) == [3]
        for w in range(3):
            srv.handle(old[(w + 1) % 3], SINK)  # replayed: answered from A's shadow
            srv.handle(_pkt(b.token, w, 3, 0, [10]), SINK)
        assert _sum_of(srv, b.token, 0) == [30]
        assert srv.snapshot()["retransmissions"] == 3
        now[0] = 100.0  # A and B expire; a new run C
        c = InaSession.create(3, "fixed")
        for w in range(3):
            srv.handle(old[w], SINK)
            srv.handle(_pkt(c.token, w, 3, 0, [100]), SINK)
        assert _sum_of(srv, c.token, 0) == [300]
        assert _sum_of(srv, a.token, 0) == [3]  # the replay only re-made A's own sum
    finally:
        srv.sock.close()


def test_a_replayed_earlier_chunk_is_answered_from_its_shadow_or_stale() -> None:
    srv = AggregatorServer()
    try:
        s = InaSession.create(2, "fixed")
        call0 = [_pkt(s.token, w, 2, 0, [w + 1]) for w in range(2)]
        for d in call0:
            srv.handle(d, SINK)
        assert _sum_of(srv, s.token, 0) == [3]
        c1 = 1 << 32
        srv.handle(_pkt(s.token, 0, 2, c1, [5]), SINK)
        srv.handle(call0[1], SINK)  # call 1 running: the shadow answers, nothing counted
        srv.handle(_pkt(s.token, 0, 2, c1, [5]), SINK)  # a duplicate of call 1's own
        srv.handle(_pkt(s.token, 1, 2, c1, [6]), SINK)
        assert _sum_of(srv, s.token, c1) == [11]
        c2 = 2 << 32
        srv.handle(_pkt(s.token, 0, 2, c2, [7]), SINK)  # call 2: call 0 is history
        assert 0 not in srv.sessions[s.token].shadows
        for d in call0:
            srv.handle(d, SINK)
        srv.handle(_pkt(s.token, 1, 2, c2, [8]), SINK)
        assert _sum_of(srv, s.token, c2) == [15]
        counters = srv.snapshot()
        assert counters["rejected_stale"] == 2 and counters["duplicates"] == 1
        assert counters["retransmissions"] == 1
    finally:
        srv.sock.close()


# ------------------------------------------------------------- bounded state
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_flood_of_new_sessions_keeps_state_within_its_bound() -> None:
    """20,000 sessions of 1024-value chunks (the old aggregator: a job and an 8 KB slot
    each, growing without end). Caps hold, a proven session survives, new ones start."""
    srv = AggregatorServer(slots=16, max_sessions=8, max_slots=64)
    try:
        live = InaSession.create(2, "fixed")
        for w in range(2):
            srv.handle(_pkt(live.token, w, 2, 0, [w]), SINK)
        rng = random.Random(0)
        values = list(range(1024))
        rss0 = _rss_bytes()
        peak = {"sessions": 0, "slots": 0, "state_bytes": 0}
        for i in range(20_000):
            srv.handle(_pkt(rng.getrandbits(64) | 1, 0, 2, rng.getrandbits(40), values), SINK)
            if i % 500 == 0:
                snap = srv.snapshot()
                for k in peak:
                    peak[k] = max(peak[k], snap[k])
        growth = _rss_bytes() - rss0
        assert peak["sessions"] <= 8 and peak["slots"] <= 64
        assert peak["state_bytes"] <= srv.state_bound
        assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB"
        counters = srv.snapshot()
        assert counters["sessions_evicted"] >= 20_000 - 8
        # the proven session is still served, and a new one can start
        for w in range(2):
            srv.handle(_pkt(live.token, w, 2, 1 << 32, [10 * (w + 1)]), SINK)
        assert _sum_of(srv, live.token, 1 << 32) == [30]
        new = InaSession.create(2, "fixed")
        for w in range(2):
            srv.handle(_pkt(new.token, w, 2, 0, [4]), SINK)
        assert _sum_of(srv, new.token, 0) == [8]
    finally:
        srv.sock.close()


def test_a_session_flood_evicts_one_member_sessions_before_a_starting_job() -> None:
    """A job whose first chunk is not complete yet (two of three members in) survives a
    flood of one-packet sessions even when it is the least recently active."""
    srv = AggregatorServer(max_sessions=4)
    try:
        s = InaSession.create(3, "fixed")
        srv.handle(_pkt(s.token, 0, 3, 0, [1]), SINK)
        srv.handle(_pkt(s.token, 1, 3, 0, [1]), SINK)
        for _ in range(1000):
            srv.handle(_pkt(random.getrandbits(64) | 1, 0, 3, 0, [900]), SINK)
        srv.handle(_pkt(s.token, 2, 3, 0, [1]), SINK)
        assert _sum_of(srv, s.token, 0) == [3]
    finally:
        srv.sock.close()


def test_sessions_full_of_proven_sessions_is_a_clear_reject() -> None:
    srv = AggregatorServer(max_sessions=2)
    try:
        for _ in range(2):
            s = InaSession.create(2, "fixed")
            for w in range(2):
                srv.handle(_pkt(s.token, w, 2, 0, [1]), SINK)
        srv.handle(_pkt(InaSession.create(2, "fixed").token, 0, 2, 0, [1]), SINK)
        counters = srv.snapshot()
        assert counters["rejected_sessions_full"] == 1 and counters["sessions"] == 2
    finally:
        srv.sock.close()


def test_a_flood_of_chunk_ids_and_a_long_run_keep_state_flat() -> None:
    """Issue 18: `count_of` kept one entry per completed chunk (200,000 after 200k
    chunks); incomplete slots never expired."""
    now = [0.0]
    srv = AggregatorServer(slots=32, max_slots=64, slot_timeout=5.0, clock=lambda: now[0])
    try:
        s = InaSession.create(2, "fixed")
        for c in range(5_000):  # one member floods chunk ids that never complete
            srv.handle(_pkt(s.token, 0, 2, c, [1]), SINK)
        assert srv.snapshot()["slots"] == 32
        assert srv.snapshot()["rejected_pool_full"] == 5_000 - 32
        now[0] = 6.0
        srv.handle(_pkt(s.token, 1, 2, 0, [1]), SINK)  # the sweep runs first: all expired
        assert srv.snapshot()["slots_expired"] == 32
        # a long run: 20 calls of 1,000 chunks, every one complete
        for call in range(1, 21):
            for i in range(1000):
                for w in range(2):
                    srv.handle(_pkt(s.token, w, 2, (call << 32) | i, [w + i]), SINK)
        snap = srv.snapshot()
        assert snap["results"] == 20_000 and snap["slots"] <= 1
        assert snap["shadows"] <= 32  # a session keeps at most `slots` shadows
        sess = srv.sessions[s.token]
        assert len(sess.slots) <= 1 and len(sess.shadows) <= 32 and len(sess.addrs) == 2
        assert snap["state_bytes"] <= srv.state_bound
        assert _sum_of(srv, s.token, (20 << 32) | 999) == [999 + 1000]
    finally:
        srv.sock.close()


def test_idle_sessions_expire() -> None:
    now = [0.0]
    srv = AggregatorServer(session_timeout=30.0, clock=lambda: now[0])
    try:
        for _ in range(5):
            srv.handle(_pkt(InaSession.create(2, "fixed").token, 0, 2, 0, [1]), SINK)
        assert srv.snapshot()["sessions"] == 5
        now[0] = 31.0
        srv.handle(b"garbage", SINK)  # any packet (or the serving loop's idle tick) sweeps
        snap = srv.snapshot()
        assert snap["sessions"] == 0 and snap["sessions_expired"] == 5
        assert snap["slots"] == 0 and snap["state_bytes"] == 0
    finally:
        srv.sock.close()


# ------------------------------------------------------------------- STATS
def test_stats_replies_are_never_longer_than_requests() -> None:
    """Issue 18: a 28-byte STATS got a 2 KB reply (80 KB for a 1,024-worker job)."""
    srv = AggregatorServer()
    me = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    me.bind(("127.0.0.1", 0))
    me.settimeout(0.5)
    try:
        s = InaSession.create(1024, "fixed")
        for c in range(64):  # 64 chunks waiting for 1,023 members
            srv.handle(_pkt(s.token, 0, 1024, c, [1]), SINK)
        worst = 0.0
        for size in (28, 32, 33, 48, 100, 300, 1200, 1400, 4000, 8000):
            for token, worker in ((0, 0), (s.token, 0), (s.token ^ 1, 0)):
                pad = bytes(max(0, size - HEADER.size))
                req = build(Packet(STATS, token, 0, worker, 1024, 0, 0, 0, pad))[:size]
                srv.handle(req, me.getsockname())
                if size < HEADER.size:  # not even a header: rejected, no answer
                    with pytest.raises(TimeoutError):
                        me.recv(65535)
                    continue
                reply = me.recv(65535)
                assert len(reply) <= len(req)
                worst = max(worst, len(reply) / len(req))
                body = parse(reply).payload
                if size >= 1200:  # a padded request gets the counters
                    import json

                    got = json.loads(body)
                    assert "counters" in got
                    assert ("session" in got) == (token == s.token)
                    if token == s.token:
                        assert got["session"]["missing"] == "1-1023"
        assert worst <= 1.0
    finally:
        me.close()
        srv.sock.close()


def test_a_dead_worker_of_a_keyed_session_is_named() -> None:
    xs = _ints(3, 500, 3)
    with AggregatorServer(secret=SECRET) as srv:
        s = InaSession.create(3, "fixed", SECRET)
        _, errs = _workers([0, 2], 3, xs, srv.address, "fixed", s, timeout=1.5)
    for r in (0, 2):
        assert isinstance(errs[r], CommTimeoutError)
        assert "waiting for worker(s) [1]" in str(errs[r]), errs[r]


@pytest.mark.parametrize(
    ("ranks", "aggregator", "says"),
    [
        (b"another secret", SECRET, "the ranks' secret is not the aggregator's --secret-file"),
        (None, SECRET, "the aggregator has a secret, the ranks none"),
        (SECRET, None, "the ranks have a secret, the aggregator none"),
    ],
)
def test_a_secret_mismatch_with_the_aggregator_is_named_as_such(
    ranks: bytes | None, aggregator: bytes | None, says: str
) -> None:
    """An audit found: ranks whose secret differs from the aggregator's (or one side
    without any) timed out told that the aggregator "holds no state of this session
    (expired?)". Its rejection counters point at the secret; the error says so (next
    to expiry: the counters are the aggregator's, every session's)."""
    xs = _ints(3, 200, 5)
    with AggregatorServer(secret=aggregator) as srv:
        s = InaSession.create(3, "fixed", ranks)
        _, errs = _workers(range(3), 3, xs, srv.address, "fixed", s, timeout=1.0)
    for e in errs:
        assert isinstance(e, CommTimeoutError), e
        assert "expired, or a secret mismatch? " in str(e) and says in str(e), e


# --------------------------------------------------------- keyed end to end
def test_sessions_are_agreed_through_the_process_group() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        return agree_session(comm, "fixed", SECRET), agree_session(comm, "fixed")

    out = run_ranks(3, fn)
    keyed, plain = out[0]
    assert all(o == (keyed, plain) for o in out)
    assert keyed.key == session_key(SECRET, keyed.token, 3, FIXED)
    assert plain.key is None and plain.token != keyed.token


@pytest.mark.parametrize("other", [None, b"another secret"])
def test_ranks_with_different_secrets_all_fail_at_once(other: bytes | None) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        try:
            agree_session(comm, "natural", SECRET if comm.rank != 1 else other)
        except ValueError as e:
            return str(e)
        return None

    out = run_ranks(3, fn)
    assert all(o is not None and "secret differs across ranks" in o for o in out), out
    assert all("from rank 0's: [1]" in o for o in out)


def test_keyed_sessions_are_exact_under_loss_and_in_training() -> None:
    xs = _ints(3, 3000, 4)
    with (
        AggregatorServer(secret=SECRET) as srv,
        LossyRelay(srv.address, 0.03, 0.03, 0.03, seed=1) as relay,
    ):
        stats = InaStats()
        s = InaSession.create(3, "fixed", SECRET)
        outs, errs = _workers(range(3), 3, xs, relay.address, "fixed", s, stats=stats)
        assert errs == [None] * 3
        assert all(torch.equal(o, _exact(xs)) for o in outs)
        out, refs = _train(2, f"{srv.address[0]}:{srv.address[1]}", 2, 5, secret=SECRET)
        for rank_out in out:
            for got, ref in zip(rank_out, refs, strict=True):
                assert torch.equal(got, ref)
        counters = srv.snapshot()
    assert counters.get("rejected", 0) == 0


# --------------------------------------------------------------- stale answers
def test_a_reused_call_number_is_refused_on_every_worker_never_answered_with_an_old_sum() -> None:
    """Issue 34: a session's call numbers used again (new data) got the earlier call's
    sums from the aggregator's shadow copies; now every worker raises instead."""
    from sparcml.ina import AggregatorRefusedError, InaSession
    from test_ina import _run

    world = 3
    with AggregatorServer() as srv:
        session = InaSession.create(world, "fixed")

        def call(xs: list[torch.Tensor], number: int) -> list[object]:
            outs, errs, _ = _run(world, xs, srv.address, "fixed", session=session,
                                 call=number, chunk=64, timeout=20)  # fmt: skip
            return [e if e is not None else o for o, e in zip(outs, errs, strict=True)]

        first = _ints(world, 500, 1)
        for got in call(first, 0):
            assert torch.equal(got, _exact(first))  # type: ignore[arg-type]
        later = _ints(world, 500, 2)
        for got in call(later, 1):
            assert torch.equal(got, _exact(later))  # type: ignore[arg-type]
        for number in (1, 0):  # the current call again, and an earlier one
            for got in call(_ints(world, 500, 3 + number), number):
                assert isinstance(got, AggregatorRefusedError), got
                # the call's shadows held: "replayed"; an earlier call dropped: "stale"
                assert "replayed" in str(got) or "stale" in str(got), got
        assert srv.snapshot()["rejected_replayed"] > 0


def test_load_state_dict_opens_a_new_aggregator_session() -> None:
    """Issue 34: state_dict, two more steps, load_state_dict, then new gradients: the
    aggregator answered 6 of 6 rank-steps with the earlier steps' sums."""
    world, n = 3, sum(SIZES)
    names = tuple(f"p{i}" for i in range(len(SIZES)))
    with AggregatorServer() as srv:
        server = f"{srv.address[0]}:{srv.address[1]}"

        def fn(comm):  # type: ignore[no-untyped-def]
            state = SparcmlState("natural_ina", comm=comm, server=server, mode="fixed")

            def step(seed: int, t: int) -> torch.Tensor:
                g = _ints(world, n, seed)[comm.rank]
                return reduce_bucket(state, Bucket(names, SIZES, g, t))

            step(1, 0)
            saved = state.state_dict()
            step(2, 1)
            step(3, 2)
            state.load_state_dict(saved)
            return [step(10 + t, 1 + t) for t in range(2)]

        for rank_out in run_ranks(world, fn):
            for t, got in enumerate(rank_out):
                assert torch.equal(got, _exact(_ints(world, n, 10 + t)) / world)
        assert srv.snapshot()["sessions_created"] == 2
