"""A packet fuzzer for the aggregator: random datagrams and mutations of valid ones.

Every input goes through :func:`~sparcml.ina.packet.parse` (which must return a
packet or raise :class:`~sparcml.ina.packet.PacketError`, nothing else) and
through a live :class:`~sparcml.ina.server.AggregatorServer`'s ``handle`` (which
must never raise), and afterwards the server must still aggregate correctly and
hold no more state than its bounds. Inputs are untagged and tagged (keyed
sessions) alike, and go to a token-mode and a keyed aggregator in turn.
"""

from __future__ import annotations

import random
import socket
import time

from .packet import (
    DATA,
    FIXED,
    NATURAL,
    RESULT,
    STATS,
    Packet,
    PacketError,
    build,
    parse,
    session_key,
)
from .server import AggregatorServer

__all__ = ["flood", "fuzz"]


_SECRET = b"fuzz-secret"


def _valid(rng: random.Random) -> bytes:
    mode = rng.choice([NATURAL, FIXED])
    count = rng.randint(1, 64)
    workers = rng.randint(1, 8)
    size = count * (1 if mode == NATURAL else 4)
    payload = bytes(rng.getrandbits(8) & (0xBF if mode == NATURAL else 0xFF) for _ in range(size))
    kind = rng.choice([DATA, DATA, DATA, RESULT, STATS])
    token = rng.randint(0, 3) if rng.random() < 0.9 else rng.getrandbits(64)
    chunk = rng.randint(0, 5) | (rng.randint(0, 2) << 32)
    p = Packet(kind, token, rng.getrandbits(32), rng.randrange(workers), workers, chunk, mode,
               count, payload)  # fmt: skip
    key = session_key(_SECRET, token, workers, mode) if rng.random() < 0.3 else None
    return build(p, key)


def _mutate(buf: bytes, rng: random.Random) -> bytes:
    b = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1:
            b = b[: rng.randint(0, len(b))]
        elif op == 2:
            b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 32)))
        elif op == 3 and len(b) >= 28:
            i = rng.randrange(28)
            b[i] = rng.getrandbits(8)
        else:
            b = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 80)))
    return bytes(b)


def fuzz(count: int = 100_000, seed: int = 0, server_every: int = 5) -> dict[str, int]:
    """Run ``count`` inputs; returns how many parsed, were rejected, reached the server.

    Raises:
        AssertionError: ``parse`` raised something else than PacketError, ``handle``
            raised, or the server no longer aggregates correctly afterwards.
    """
    rng = random.Random(seed)
    out = {"inputs": 0, "parsed": 0, "rejected": 0, "served": 0}
    # not started: handle() is called directly
    servers = [
        AggregatorServer(slots=64, max_sessions=32, max_slots=512),
        AggregatorServer(slots=64, max_sessions=32, max_slots=512, secret=_SECRET),
    ]
    sink = ("127.0.0.1", 9)  # discard port: results of fuzzed jobs go nowhere
    t0 = time.monotonic()
    try:
        for i in range(count):
            buf = _mutate(_valid(rng), rng) if rng.random() < 0.8 else _valid(rng)
            out["inputs"] += 1
            try:
                parse(buf)
                out["parsed"] += 1
            except PacketError:
                out["rejected"] += 1
            if i % server_every == 0:
                servers[(i // server_every) % 2].handle(buf, sink)
                out["served"] += 1
        for srv in servers:
            # the state stayed within the bounds
            snap = srv.snapshot()
            assert snap["sessions"] <= srv.max_sessions and snap["slots"] <= srv.max_slots
            assert snap["state_bytes"] <= srv.state_bound, snap
            # the aggregator still adds correctly after the storm (a fresh session)
            token, a, b = 2**63 + 999, b"\x00\x00\x00\x05", b"\x00\x00\x00\x07"
            key = session_key(_SECRET, token, 2, FIXED) if srv.secret else None
            srv.handle(build(Packet(DATA, token, 0, 0, 2, 0, FIXED, 1, a), key), sink)
            srv.handle(build(Packet(DATA, token, 0, 1, 2, 0, FIXED, 1, b), key), sink)
            shadow = srv.sessions[token].shadows[0].out
            assert parse(shadow).payload == (12).to_bytes(8, "big"), "aggregation broken"
            out["sessions_created"] = out.get("sessions_created", 0) + snap.get(
                "sessions_created", 0
            )
    finally:
        for srv in servers:
            srv.sock.close()
    out["seconds"] = int(time.monotonic() - t0)
    return out


def _rss() -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def flood(sessions: int = 20_000, chunks: int = 200_000, seed: int = 0) -> dict[str, float]:
    """The aggregator's state under floods, its STATS replies, and the cost of tags.

    On an aggregator with the default bounds (not started: ``handle`` is called
    directly): ``sessions`` DATA packets of 1024 int32 values, each of a new
    random session (never completed); one 2-member session completing ``chunks``
    chunks of 256 natural codes (calls of 1,000 chunks); STATS requests of a
    stranger and of a member of a 1,024-member session; ``handle`` time per packet
    in a token and in a keyed session. Returns the figures docs/ina.md quotes.
    """
    rng = random.Random(seed)
    sink = ("127.0.0.1", 9)
    out: dict[str, float] = {}
    srv = AggregatorServer()
    try:
        out["state_bound_bytes"] = srv.state_bound
        rss0 = _rss()
        payload = bytes(4096)
        peak_sessions = peak_slots = peak_state = 0
        for i in range(sessions):
            srv.handle(build(Packet(DATA, rng.getrandbits(64) | 1, 0, 0, 2, rng.getrandbits(40),
                                    FIXED, 1024, payload)), sink)  # fmt: skip
            if i % 100 == 0 or i == sessions - 1:
                snap = srv.snapshot()
                peak_sessions = max(peak_sessions, snap["sessions"])
                peak_slots = max(peak_slots, snap["slots"])
                peak_state = max(peak_state, snap["state_bytes"])
        out |= {"flood_sessions": sessions, "flood_peak_sessions": peak_sessions,
                "flood_peak_slots": peak_slots, "flood_peak_state_bytes": peak_state,
                "flood_rss_growth_bytes": _rss() - rss0}  # fmt: skip
        token = rng.getrandbits(64) | 1
        codes = bytes(rng.getrandbits(5) for _ in range(256))
        rss0 = _rss()
        t0 = time.perf_counter()
        for i in range(chunks):
            chunk = ((i // 1000 + 1) << 32) | (i % 1000)
            for w in range(2):
                srv.handle(build(Packet(DATA, token, 0, w, 2, chunk, NATURAL, 256, codes)), sink)
        assert srv.snapshot()["results"] == chunks, "the training packets were rejected"
        out["train_chunks"] = chunks
        out["train_us_per_packet"] = (time.perf_counter() - t0) / (2 * chunks) * 1e6
        s = srv.sessions[token]
        out |= {"train_slots": len(s.slots), "train_shadows": len(s.shadows),
                "train_state_bytes": srv.snapshot()["state_bytes"],
                "train_rss_growth_bytes": _rss() - rss0}  # fmt: skip
        # STATS: replies of a stranger and of a member of a 1,024-member session
        big = rng.getrandbits(64) | 1
        for c in range(64):
            srv.handle(build(Packet(DATA, big, 0, 0, 1024, c, FIXED, 1, bytes(4))), sink)
        me = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        me.bind(("127.0.0.1", 0))
        me.settimeout(1.0)
        try:
            asks = [("stranger_bare", 0, 32), ("stranger_padded", 0, 1200),
                    ("member_bare", big, 32), ("member_padded", big, 1200)]  # fmt: skip
            for name, tok, size in asks:
                req = build(Packet(STATS, tok, 0, 0, 1024, 0, 0, 0, bytes(size - 32)))
                srv.handle(req, me.getsockname())
                out[f"stats_{name}_request"] = len(req)
                out[f"stats_{name}_reply"] = len(me.recv(65535))
        finally:
            me.close()
    finally:
        srv.sock.close()
    # the cost of tags: handle() per natural 1024-value packet, token vs keyed sessions
    for name, secret in (("token", None), ("keyed", _SECRET)):
        srv = AggregatorServer(secret=secret)
        try:
            token = rng.getrandbits(64) | 1
            key = session_key(secret, token, 2, NATURAL) if secret else None
            codes = bytes(rng.getrandbits(5) for _ in range(1024))
            pkts = [build(Packet(DATA, token, 0, w, 2, c, NATURAL, 1024, codes), key)
                    for c in range(2000) for w in range(2)]  # fmt: skip
            t0 = time.perf_counter()
            for b in pkts:
                srv.handle(b, sink)
            assert srv.snapshot()["results"] == 2000, f"{name}: packets were rejected"
            out[f"{name}_us_per_1024_value_packet"] = (time.perf_counter() - t0) / len(pkts) * 1e6
        finally:
            srv.sock.close()
    return out
