"""In-network aggregation: exact integer sums through the aggregator, under loss,
duplication and reordering (our lossy relay), with the faults the issue names.

References: ``FIXED`` — the exact sum of the workers' int32 values; ``NATURAL`` —
the sum of the workers' 8-bit codes restored to integers, re-compressed to the
nearer power of two (the aggregator's ``master_rounding="nearest"``), decoded.
Both must match bit for bit on every worker.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparcml.errors import CommTimeoutError
from sparcml.ina import (
    AggregatorRestartedError,
    AggregatorServer,
    InaSession,
    InaStats,
    LossyRelay,
    PacketError,
    ina_allreduce,
    natural_compress_integers,
    parse,
)
from sparcml.ina.packet import DATA, FIXED, HEADER, NATURAL, Packet, build
from sparcml.ina.worker import encode_natural, worker_seed

JOB = 11


def _inputs(world: int, n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(r)) * 3 for r in range(world)]


def _run(world, xs, target, mode, job=JOB, session=None, **kw):  # type: ignore[no-untyped-def]
    """``world`` workers (threads) of one session (a new one unless given)."""
    outs: list = [None] * world
    errs: list = [None] * world
    stats = [InaStats() for _ in range(world)]
    sess = session if session is not None else InaSession.create(world, mode)

    def body(r: int) -> None:
        try:
            outs[r] = ina_allreduce(
                xs[r], target, sess, r, world, mode, job=job, stats=stats[r], **kw
            )
        except Exception as e:
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outs, errs, stats


def _natural_reference(xs: list[torch.Tensor], world: int, e_min: int = -50) -> torch.Tensor:
    total = np.zeros(xs[0].numel(), dtype=np.int64)
    for r, x in enumerate(xs):
        codes, _ = encode_natural(x, e_min, world, worker_seed(0, JOB, r))
        c = codes.astype(np.int64)
        v = np.where((c >> 6) & 1, 0, np.int64(1) << (c & 63))
        total += np.where((c >> 7) & 1, -v, v)
    codes, _ = natural_compress_integers(total, None)
    c = torch.from_numpy(codes.astype(np.int64))
    out = torch.ldexp(torch.ones(c.numel()), ((c & 63) + e_min).float())
    out = torch.where(((c >> 6) & 1).bool(), torch.zeros_like(out), out)
    return torch.where(((c >> 7) & 1).bool(), -out, out)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("faults", [(0.0, 0.0, 0.0), (0.01, 0.01, 0.01), (0.05, 0.05, 0.05)])
def test_exact_sums_under_loss_duplication_and_reordering(world: int, faults) -> None:  # type: ignore[no-untyped-def]
    n = 3000 + world  # not a multiple of the chunk
    xs = _inputs(world, n)
    fixed_ref = sum(torch.round(x.double() * 2**16) for x in xs) / 2**16
    nat_ref = _natural_reference(xs, world)
    with (
        AggregatorServer(master_rounding="nearest") as srv,
        LossyRelay(srv.address, *faults, seed=world) as relay,
    ):
        retransmissions = 0
        for mode, ref in (("fixed", fixed_ref.float()), ("natural", nat_ref)):
            outs, errs, stats = _run(
                world, xs, relay.address, mode, job=JOB if mode == "natural" else JOB + 1
            )
            assert errs == [None] * world, errs
            retransmissions += sum(s.retransmissions for s in stats)
            for o in outs:
                assert torch.equal(o, ref)
        counters = srv.snapshot()
    assert counters.get("rejected", 0) == 0
    if relay.counts["dropped"]:  # whatever was lost was recovered by retransmission
        assert retransmissions > 0


def test_two_jobs_on_one_aggregator_do_not_mix() -> None:
    xs, ys = _inputs(3, 700), [x * -2 for x in _inputs(3, 700)]
    with AggregatorServer() as srv:
        res: dict = {}
        t1 = threading.Thread(target=lambda: res.update(a=_run(3, xs, srv.address, "fixed", job=1)))
        t2 = threading.Thread(target=lambda: res.update(b=_run(3, ys, srv.address, "fixed", job=2)))
        t1.start()
        t2.start()
        t1.join()
        t2.join()
    ref_a = (sum(torch.round(x.double() * 2**16) for x in xs) / 2**16).float()
    ref_b = (sum(torch.round(y.double() * 2**16) for y in ys) / 2**16).float()
    assert all(torch.equal(o, ref_a) for o in res["a"][0])
    assert all(torch.equal(o, ref_b) for o in res["b"][0])


def test_malformed_packets_are_counted_and_service_goes_on() -> None:
    with AggregatorServer() as srv:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        good = build(Packet(DATA, 5, 0, 0, 2, 0, FIXED, 2, b"\x00" * 8))  # session 5
        bad = [
            b"", b"xx", b"XX" + good[2:],                     # truncated, truncated, bad magic
            good[:2] + b"\x07" + good[3:],                    # version 7
            good[:-1],                                        # payload one byte short
            build(Packet(DATA, 5, 0, 3, 2, 0, FIXED, 2, b"\x00" * 8)),   # worker 3 of 2
            build(Packet(DATA, 5, 0, 0, 2, 0, NATURAL, 1, b"\x3f")),     # offset 63: overflow
        ]  # fmt: skip
        for b in bad:
            s.sendto(b, srv.address)
        s.close()
        xs = _inputs(2, 100)
        _outs, errs, _ = _run(2, xs, srv.address, "fixed", job=6)
        assert errs == [None, None]
        counters = srv.snapshot()
    assert counters["rejected"] == len(bad)
    for reason in ("truncated", "bad_magic", "bad_version", "bad_length", "bad_worker"):
        assert counters.get(f"rejected_{reason}", 0) >= 1
    assert counters.get("rejected_overflow", 0) == 1


def test_a_dead_worker_is_named_by_the_others() -> None:
    xs = _inputs(3, 500)
    session = InaSession.create(3, "natural")
    with AggregatorServer() as srv:
        outs: list = [None] * 3

        def body(r: int) -> None:
            try:
                ina_allreduce(xs[r], srv.address, session, r, 3, "natural", timeout=1.5)
            except CommTimeoutError as e:
                outs[r] = str(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in (0, 2)]  # worker 1 is dead
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for r in (0, 2):
        assert outs[r] is not None and "waiting for worker(s) [1]" in outs[r]


class _RestartsAtThirdResult(AggregatorServer):
    """An aggregator that changes incarnation after its third result, inside the
    server (what a restart looks like to the workers): no clock decides when."""

    restarted = False

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        super()._send(data, addr)
        if self.counters["results"] == 3 and not self.restarted:
            self.restarted = True
            self.epoch ^= 2  # later results carry a new epoch


def test_a_restarted_aggregator_is_detected() -> None:
    """After its third result the aggregator changes incarnation (what a restart looks
    like to the workers): the change happens inside the server, at that result, so
    no clock or polling decides when."""

    xs = _inputs(2, 5000)
    session = InaSession.create(2, "fixed")
    with _RestartsAtThirdResult() as srv:
        port = srv.address[1]
        errs: list = [None, None]

        def body(r: int) -> None:
            try:
                ina_allreduce(
                    xs[r], srv.address, session, r, 2, "fixed", chunk=64, window=4, timeout=5
                )
            except Exception as e:
                errs[r] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert port
    assert all(isinstance(e, AggregatorRestartedError) for e in errs), errs


def test_bytes_per_value_on_the_wire() -> None:
    stats = InaStats()
    with AggregatorServer() as srv:
        _run(1, [torch.randn(4096)], srv.address, "natural")
        session = InaSession.create(1, "natural")
        ina_allreduce(torch.randn(4096), srv.address, session, 0, 1, "natural", stats=stats)
    # one byte per value plus a 32-byte header per 256-value packet: 9 bits per value
    assert HEADER.size == 32
    assert stats.bytes_sent * 8 / 4096 <= 8 + 32 * 8 / 256 + 1e-9


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_parser_fuzz_never_crashes(data: bytes) -> None:
    try:
        p = parse(data)
    except PacketError:
        return
    assert len(data) >= HEADER.size and isinstance(p, Packet)


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size + 64))
def test_parser_fuzz_on_valid_magic(data: bytes) -> None:
    data = b"SI\x02" + data[3:]
    try:
        parse(data)
    except PacketError as e:
        assert e.reason


def test_repeated_calls_in_one_job_never_meet_old_results() -> None:
    session = InaSession.create(3, "fixed")
    with AggregatorServer() as srv:
        for call in range(3):
            xs = [x * (call + 1) for x in _inputs(3, 900)]
            outs, errs, _ = _run(3, xs, srv.address, "fixed", session=session, call=call)
            assert errs == [None] * 3
            ref = (sum(torch.round(x.double() * 2**16) for x in xs) / 2**16).float()
            assert all(torch.equal(o, ref) for o in outs)


def test_fuzz_100k_inputs_no_crash_and_still_aggregating() -> None:
    from sparcml.ina.fuzz import fuzz

    out = fuzz(100_000, seed=3)
    assert out["inputs"] == 100_000 and out["parsed"] > 1000 and out["rejected"] > 1000


@pytest.mark.spawn
def test_bench_ina_runs_under_torchrun() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m",
           "sparcml.tools.cli", "bench-ina", "--env", "-N", "8K", "--repeats", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 workers + 1 aggregator host" in done.stdout
    for name in ("gloo ring all_reduce", "ina natural", "ina fixed"):
        assert name in done.stdout


def test_an_empty_vector_needs_no_aggregator() -> None:
    out = ina_allreduce(torch.zeros(0), ("127.0.0.1", 9), InaSession(1), 0, 2, "natural", timeout=1)
    assert out.numel() == 0


def test_a_result_dropped_for_room_is_refused_when_asked_again() -> None:
    """An audit found: with ``slots`` below the workers' window a complete chunk's
    shadow could be dropped before a worker that lost the result asked again; the
    retransmission then opened a slot no other member would fill, and the call timed
    out blaming a healthy worker. Now it is refused as 'evicted', naming --slots."""
    from sparcml.ina.packet import REFUSED, RESULT

    with AggregatorServer(slots=2) as srv:
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.settimeout(5)

        def data(worker: int, chunk: int) -> bytes:
            return build(Packet(DATA, 9, 77, worker, 2, chunk, FIXED, 2, b"\x00" * 8))

        for chunk in range(4):  # four complete chunks; two shadows kept
            for worker in (0, 1):
                a.sendto(data(worker, chunk), srv.address)
        got = [parse(a.recv(65535)) for _ in range(8)]  # each result to both members
        assert sorted(p.chunk for p in got if p.kind == RESULT) == [0, 0, 1, 1, 2, 2, 3, 3]
        a.sendto(data(1, 3), srv.address)  # kept: answered from the shadow
        assert parse(a.recv(65535)).kind == RESULT
        a.sendto(data(1, 0), srv.address)  # dropped for room: refused, not a new slot
        refused = parse(a.recv(65535))
        other_call = build(Packet(DATA, 9, 78, 1, 2, 0, FIXED, 2, b"\x00" * 8))
        a.sendto(other_call, srv.address)  # the chunk from another call: replayed
        replayed = parse(a.recv(65535))
        a.close()
        counters = srv.snapshot()
    assert replayed.kind == REFUSED and replayed.payload.decode().startswith("replayed")
    assert refused.kind == REFUSED and refused.chunk == 0
    assert refused.payload.decode().startswith("evicted")  # (cut to the payload length)
    assert counters["slots"] == 0 and counters.get("rejected_evicted") == 1


def test_a_lost_result_is_asked_again_before_it_is_dropped_for_room() -> None:
    """A worker whose result of one chunk was lost (twice) kept sending later chunks
    (its window counted outstanding chunks, not their span), so the other worker's
    chunks completed until the aggregator, keeping ``slots`` results (here as many
    as the window), dropped the lost one: the worker was refused 'evicted' and the
    other timed out blaming it. With SwitchML's pool (chunk ``j`` only once ``j <``
    oldest outstanding + window) ``slots >= window`` keeps it."""
    from sparcml.ina.packet import RESULT

    class Lossy(AggregatorServer):
        dropped = 0

        def _send(self, data, addr):  # type: ignore[no-untyped-def]
            p = parse(data)
            if (
                p.kind == RESULT
                and p.chunk & 0xFFFFFFFF == 5
                and self.dropped < 2
                and addr == self.sessions[p.session].addrs[0]
            ):
                self.dropped += 1  # worker 0's result of chunk 5, and its answer to a resend
                return
            super()._send(data, addr)

    xs = [torch.ones(256 * 600), torch.ones(256 * 600)]
    with Lossy(slots=64) as srv:
        outs, errs, stats = _run(2, xs, srv.address, "fixed", window=64, timeout=10)
        assert srv.dropped == 2
    assert errs == [None, None]
    assert all(torch.equal(o, torch.full((256 * 600,), 2.0)) for o in outs)
    assert stats[0].retransmissions >= 2


def test_workers_whose_sizes_differ_are_all_refused_at_once() -> None:
    """A chunk whose members send different counts is refused to every one of them
    (a REFUSED packet each), not left to their timeouts naming a healthy worker."""
    import time

    from sparcml.ina import AggregatorRefusedError

    with AggregatorServer() as srv:
        t0 = time.monotonic()
        _, errs, _ = _run(2, [torch.ones(300), torch.ones(200)], srv.address, "fixed", timeout=30)
        took = time.monotonic() - t0
    assert all(isinstance(e, AggregatorRefusedError) for e in errs), errs
    assert all("count_mismatch" in str(e) for e in errs) and took < 10


def test_fixed_point_refuses_nan_instead_of_summing_zero() -> None:
    """``float(NaN) > bound`` is False and NaN cast to an integer became 0: a NaN was
    summed as zero. Refused before any packet, as the natural mode does."""
    with pytest.raises(ValueError, match="non-finite"):
        ina_allreduce(
            torch.tensor([float("nan"), 1.0]), ("127.0.0.1", 9), InaSession(1), 0, 2, "fixed",
            timeout=1,
        )  # fmt: skip


def test_a_clipped_value_is_counted_once_and_bad_timing_arguments_refused() -> None:
    """A value beyond the 8-bit format's top (2^13 at e_min = -50) was counted twice
    (the format's clip and the offset bound for the session's size); a retransmission
    interval or timeout of 0 made the socket non-blocking instead of an error."""
    _, clipped = encode_natural(torch.tensor([1e5, 3.0, 5000.0]), -50, 8, 0)
    assert clipped == 2  # 1e5 beyond the format, 5000 beyond 2^(12 - 3) for 8 workers
    for bad in ({"retransmit": 0}, {"timeout": 0}, {"retransmit": -1.0}):
        with pytest.raises(ValueError, match="must be positive"):
            ina_allreduce(torch.ones(3), ("127.0.0.1", 9), InaSession(1), 0, 2, "fixed", **bad)


def test_a_serving_thread_survives_a_packet_that_raises() -> None:
    """A bug in one packet's handling ended the serving thread, and ``sparcml
    ina-server`` kept printing counters of a dead aggregator; the packet is now
    counted and logged, and the service goes on."""

    class Flaky(AggregatorServer):
        raised = False

        def handle(self, buf, addr):  # type: ignore[no-untyped-def]
            if not self.raised:
                self.raised = True
                raise RuntimeError("a handler bug")
            return super().handle(buf, addr)

    with Flaky() as srv:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"x", srv.address)
        s.close()
        xs = _inputs(2, 300)
        _, errs, _ = _run(2, xs, srv.address, "fixed", timeout=10)
        assert srv.serving and errs == [None, None]
        assert srv.snapshot().get("handler_errors") == 1


def test_a_chunk_refused_as_a_whole_is_refused_to_every_member() -> None:
    """Counts 10, 12, 10 from three members: the first two were refused, but the
    third matched the slot kept for the first, was summed, and waited for a result
    that never came. The chunk is now refused as a whole: every member that sent it
    and every member that sends it later is told."""
    from sparcml.ina.packet import REFUSED

    with AggregatorServer() as srv:
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.settimeout(5)

        def data(worker: int, count: int) -> bytes:
            return build(Packet(DATA, 9, 77, worker, 3, 0, FIXED, count, b"\x00" * 4 * count))

        for worker, count in ((0, 10), (1, 12), (2, 10)):
            a.sendto(data(worker, count), srv.address)
        got = [parse(a.recv(65535)) for _ in range(3)]
        a.close()
        counters = srv.snapshot()
    assert all(p.kind == REFUSED for p in got)
    assert sorted(p.worker for p in got) == [0, 1, 2]
    assert all(p.payload.decode().startswith("count_mismatch") for p in got)
    assert counters["slots"] == 0


def test_a_refusal_from_a_restarted_aggregator_names_the_restart() -> None:
    """A restarted aggregator refuses an earlier call's chunks as 'stale' (a call
    number used twice, it says): a worker that had results of that call from the old
    incarnation now raises ``AggregatorRestartedError`` (the epochs differ), not a
    refusal with the wrong diagnosis."""

    class Restarted(_RestartsAtThirdResult):
        def _data(self, p, buf, addr, now):  # type: ignore[no-untyped-def]
            s = self.sessions.get(p.session)
            if self.restarted and s is not None:  # the new incarnation's answer
                self._refuse(s, p, addr, "stale", "calls of a session only go forward")
                return None
            return super()._data(p, buf, addr, now)

    with Restarted() as srv:
        _, errs, _ = _run(2, _inputs(2, 5000), srv.address, "fixed", chunk=64, window=4,
                          timeout=5)  # fmt: skip
    assert all(isinstance(e, AggregatorRestartedError) for e in errs), errs


def test_the_lossy_relay_closes_idle_upstream_sockets() -> None:
    """A worker opens a new UDP port for every call, and the relay kept one upstream
    socket for each until it stopped (out of descriptors in a long run, which ended
    its thread). Idle ones are closed now."""
    import time

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    with LossyRelay(sink.getsockname(), idle=0.3) as relay:
        clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(5)]
        for c in clients:
            c.sendto(b"x", relay.address)
        deadline = time.monotonic() + 5
        while len(relay.upstream) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(relay.upstream) == 5
        while relay.upstream and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not relay.upstream and relay.counts["forwarded"] == 5
        for c in clients:
            c.close()
    sink.close()
