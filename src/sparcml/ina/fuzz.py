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

__all__ = ["fuzz"]


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
            shadow = srv.sessions[token].shadows[0]
            assert parse(shadow).payload == (12).to_bytes(8, "big"), "aggregation broken"
            out["sessions_created"] = out.get("sessions_created", 0) + snap.get(
                "sessions_created", 0
            )
    finally:
        for srv in servers:
            srv.sock.close()
    out["seconds"] = int(time.monotonic() - t0)
    return out
