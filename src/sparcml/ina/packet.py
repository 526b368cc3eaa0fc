"""The packet format of sparcml's in-network aggregation (paper 004 sec. 5, appendix A).

One UDP datagram per packet: a 28-byte header, then the payload::

    magic "SI" | version u8 | kind u8 | job u32 | epoch u32 | worker u16 | workers u16
    | chunk u64 | mode u8 | flags u8 | count u16          (network byte order)

* ``DATA`` (worker -> aggregator): ``count`` values of chunk ``chunk`` of job ``job``
  from ``worker`` (of ``workers``). Mode ``NATURAL``: one byte per value, the
  8-bit natural-compression code of appendix A (sign, zero flag, 6-bit exponent
  offset). Mode ``FIXED``: ``count`` big-endian int32 fixed-point values.
* ``RESULT`` (aggregator -> workers): the chunk's aggregate: ``NATURAL``: the
  8-bit codes of the re-compressed sum (master-side compression); ``FIXED``:
  ``count`` big-endian int64 sums. ``epoch`` is the aggregator's incarnation.
* ``STATS`` / ``STATS_REPLY``: counters and, for ``job``, the workers missing from
  each incomplete chunk, as JSON.

:func:`parse` checks everything and raises :class:`PacketError` naming what is
wrong; it never reads past the datagram.
"""

from __future__ import annotations

import dataclasses
import struct

__all__ = [
    "DATA",
    "FIXED",
    "HEADER",
    "MAX_COUNT",
    "NATURAL",
    "RESULT",
    "STATS",
    "STATS_REPLY",
    "VERSION",
    "Packet",
    "PacketError",
    "build",
    "parse",
]

MAGIC = b"SI"
VERSION = 1
HEADER = struct.Struct("!2sBBIIHHQBBH")
assert HEADER.size == 28
DATA, RESULT, STATS, STATS_REPLY = 1, 2, 3, 4
NATURAL, FIXED = 1, 2
MAX_COUNT = 1024  # values per packet: 1 KB of natural codes, 8 KB of int64 sums
MAX_WORKERS = 1024


class PacketError(ValueError):
    """A datagram that is not a valid packet; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass(frozen=True)
class Packet:
    kind: int
    job: int
    epoch: int
    worker: int
    workers: int
    chunk: int
    mode: int
    count: int
    payload: bytes
    flags: int = 0


def _value_bytes(kind: int, mode: int) -> int:
    if kind == DATA:
        return 1 if mode == NATURAL else 4
    return 1 if mode == NATURAL else 8


def build(p: Packet) -> bytes:
    return (
        HEADER.pack(
            MAGIC,
            VERSION,
            p.kind,
            p.job,
            p.epoch,
            p.worker,
            p.workers,
            p.chunk,
            p.mode,
            p.flags,
            p.count,
        )
        + p.payload
    )


def parse(buf: bytes) -> Packet:
    """The packet ``buf`` holds; raises :class:`PacketError` for anything malformed."""
    if len(buf) < HEADER.size:
        raise PacketError("truncated", f"{len(buf)} bytes, the header needs {HEADER.size}")
    magic, version, kind, job, epoch, worker, workers, chunk, mode, flags, count = (
        HEADER.unpack_from(buf)
    )
    if magic != MAGIC:
        raise PacketError("bad_magic", f"magic {magic!r}")
    if version != VERSION:
        raise PacketError("bad_version", f"version {version}, this is {VERSION}")
    if kind not in (DATA, RESULT, STATS, STATS_REPLY):
        raise PacketError("bad_kind", f"kind {kind}")
    payload = bytes(buf[HEADER.size :])
    if kind in (STATS, STATS_REPLY):
        return Packet(kind, job, epoch, worker, workers, chunk, mode, count, payload, flags)
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
    return Packet(kind, job, epoch, worker, workers, chunk, mode, count, payload, flags)
