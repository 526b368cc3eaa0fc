"""The packet format of sparcml's in-network aggregation (paper 004 sec. 5, appendix A).

One UDP datagram per packet: a 32-byte header, the payload, and in keyed
sessions a 16-byte tag::

    magic "SI" | version u8 | kind u8 | flags u8 | mode u8 | count u16 | worker u16
    | workers u16 | epoch u32 | session u64 | chunk u64     (network byte order)
    [ payload ] [ tag: 16 bytes, when flags has MAC ]

* ``DATA`` (worker -> aggregator): ``count`` values of chunk ``chunk`` of the
  session whose random 64-bit token is ``session``, from member ``worker`` (of
  ``workers``). Mode ``NATURAL``: one byte per value, the 8-bit
  natural-compression code of appendix A (sign, zero flag, 6-bit exponent
  offset). Mode ``FIXED``: ``count`` big-endian int32 fixed-point values.
  ``chunk`` is ``call * 2^32 + index``: calls of a session only go forward.
* ``RESULT`` (aggregator -> workers): the chunk's aggregate: ``NATURAL``: the
  8-bit codes of the re-compressed sum (master-side compression); ``FIXED``:
  ``count`` big-endian int64 sums. ``epoch`` is the aggregator's incarnation.
  In ``DATA``, ``epoch`` carries the worker's *call nonce* instead: a random
  number drawn per :func:`~sparcml.ina.worker.ina_allreduce` call, the same in
  its retransmissions, so the aggregator tells a retransmission (answered from
  its shadow copy) from a second call that reuses the chunk ids (refused).
* ``REFUSED`` (aggregator -> worker): chunk ``chunk`` of this worker's call was
  refused; the payload is the reason (``count`` bytes of UTF-8), tagged in a
  keyed session like a result. Sent for a call number reused in a live session
  (a replay: its results would be an earlier call's) and for a chunk of a call
  the session is past.
* ``STATS`` / ``STATS_REPLY``: a request (any payload: padding) and its answer,
  JSON, never longer than the request (see :mod:`~sparcml.ina.server`).

Version 2 (this one) replaced version 1's 32-bit job number, which any run or
any stranger could reuse, by the session token, and added the optional tag: a
keyed BLAKE2b MAC (:func:`mac`) of the whole datagram under the session's key
(:func:`session_key`). Paper 004 (appendix A) and SwitchML trust the network;
these are sparcml's additions, the threat model is in docs/ina.md.

:func:`parse` checks everything and raises :class:`PacketError` naming what is
wrong; it never reads past the datagram. It does not check tags (it has no
key): :func:`verify` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

__all__ = [
    "DATA",
    "FIXED",
    "FLAG_MAC",
    "HEADER",
    "MAX_COUNT",
    "NATURAL",
    "REFUSED",
    "RESULT",
    "STATS",
    "STATS_REPLY",
    "TAG_BYTES",
    "VERSION",
    "WINDOW",
    "Packet",
    "PacketError",
    "build",
    "mac",
    "parse",
    "session_key",
    "verify",
]

MAGIC = b"SI"
VERSION = 2
HEADER = struct.Struct("!2sBBBBHHHIQQ")
assert HEADER.size == 32
DATA, RESULT, STATS, STATS_REPLY, REFUSED = 1, 2, 3, 4, 5
NATURAL, FIXED = 1, 2
FLAG_MAC = 0x01
TAG_BYTES = 16
MAX_COUNT = 1024  # values per packet: 1 KB of natural codes, 8 KB of int64 sums
MAX_WORKERS = 1024
#: chunks a worker keeps outstanding by default (SwitchML's pool): the aggregator
#: should keep at least as many complete chunks' results per session (``slots``)
WINDOW = 64
MAX_STATS_BYTES = 8192  # a STATS request or reply, padding included


class PacketError(ValueError):
    """A datagram that is not a valid packet; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass(frozen=True)
class Packet:
    kind: int
    session: int
    epoch: int
    worker: int
    workers: int
    chunk: int
    mode: int
    count: int
    payload: bytes
    flags: int = 0


def _value_bytes(kind: int, mode: int) -> int:
    if kind == REFUSED:  # the reason, as text
        return 1
    if kind == DATA:
        return 1 if mode == NATURAL else 4
    return 1 if mode == NATURAL else 8


def session_key(secret: bytes, token: int, workers: int, mode: int) -> bytes:
    """The MAC key of one session: BLAKE2b keyed with the aggregator's ``secret`` over
    the session's token and membership (``workers``, ``mode``), so a tag also
    authenticates the membership the session was created with."""
    if not 1 <= len(secret) <= 64:
        raise ValueError(f"the secret must be 1..64 bytes, got {len(secret)}")
    data = struct.pack("!QHB", token, workers, mode)
    return hashlib.blake2b(data, key=secret, digest_size=32, person=b"sparcml-ina-kdf").digest()


def mac(key: bytes, data: bytes) -> bytes:
    """The 16-byte tag of ``data`` (a datagram without its tag) under a session key."""
    return hashlib.blake2b(data, key=key, digest_size=TAG_BYTES, person=b"sparcml-ina-mac").digest()


def verify(buf: bytes, key: bytes) -> bool:
    """Whether datagram ``buf`` (parsed already, with ``FLAG_MAC``) carries a valid tag."""
    if len(buf) < HEADER.size + TAG_BYTES:
        return False
    return hmac.compare_digest(mac(key, buf[:-TAG_BYTES]), buf[-TAG_BYTES:])


def build(p: Packet, key: bytes | None = None) -> bytes:
    """The datagram of ``p``; with ``key``, flagged and tagged (:func:`mac`)."""
    flags = p.flags | FLAG_MAC if key is not None else p.flags & ~FLAG_MAC
    body = (
        HEADER.pack(
            MAGIC,
            VERSION,
            p.kind,
            flags,
            p.mode,
            p.count,
            p.worker,
            p.workers,
            p.epoch,
            p.session,
            p.chunk,
        )
        + p.payload
    )
    return body + mac(key, body) if key is not None else body


def parse(buf: bytes) -> Packet:
    """The packet ``buf`` holds; raises :class:`PacketError` for anything malformed."""
    if len(buf) < HEADER.size:
        raise PacketError("truncated", f"{len(buf)} bytes, the header needs {HEADER.size}")
    if len(buf) > MAX_STATS_BYTES + HEADER.size + TAG_BYTES:
        raise PacketError("too_long", f"{len(buf)} bytes")
    magic, version, kind, flags, mode, count, worker, workers, epoch, session, chunk = (
        HEADER.unpack_from(buf)
    )
    if magic != MAGIC:
        raise PacketError("bad_magic", f"magic {magic!r}")
    if version != VERSION:
        raise PacketError("bad_version", f"version {version}, this is {VERSION}")
    if kind not in (DATA, RESULT, STATS, STATS_REPLY, REFUSED):
        raise PacketError("bad_kind", f"kind {kind}")
    if flags & ~FLAG_MAC:
        raise PacketError("bad_flags", f"flags {flags:#x}")
    tag = TAG_BYTES if flags & FLAG_MAC else 0
    if len(buf) < HEADER.size + tag:
        raise PacketError("truncated", f"{len(buf)} bytes, header and tag need {HEADER.size + tag}")
    payload = bytes(buf[HEADER.size : len(buf) - tag])
    if kind in (STATS, STATS_REPLY):
        if len(payload) > MAX_STATS_BYTES:
            raise PacketError("too_long", f"{len(payload)} payload bytes")
        return Packet(kind, session, epoch, worker, workers, chunk, mode, count, payload, flags)
    if session == 0:
        raise PacketError("bad_session", "session token 0")
    if mode not in (NATURAL, FIXED):
        raise PacketError("bad_mode", f"mode {mode}")
    if not 1 <= workers <= MAX_WORKERS or worker >= workers:
        raise PacketError("bad_worker", f"worker {worker} of {workers}")
    if not 1 <= count <= MAX_COUNT:
        raise PacketError("bad_count", f"count {count}")
    want = count * _value_bytes(kind, mode)
    if len(payload) != want:
        raise PacketError(
            "bad_length", f"{len(payload)} payload bytes for {count} values, want {want}"
        )
    return Packet(kind, session, epoch, worker, workers, chunk, mode, count, payload, flags)
