"""The aggregator: an integer-only adder emulating a SwitchML-style switch (paper 004 App. A).

Per job and chunk the aggregator keeps a slot: an int64 accumulator and the set
of workers already counted. For each ``DATA`` packet:

1. check it (:func:`~sparcml.ina.packet.parse`; rejects are counted by reason
   and logged, the service goes on);
2. if the chunk is complete already, answer from the slot's **shadow copy** of
   the result (the worker lost the result and retransmitted: SwitchML's
   recovery) — a duplicate is never counted twice;
3. if this worker was counted for the chunk already, drop it (duplicate);
4. restore integers: natural codes become ``±2^offset`` (units of ``2^e_min``) by
   a shift, fixed-point values are already integers; add them (int64);
5. when all workers are in: the result — ``FIXED``: the int64 sums; ``NATURAL``:
   the sum re-compressed to 8-bit codes (master-side compression, stochastic
   from a generator seeded by (job, chunk), or nearest) — is kept as the shadow
   copy and sent to every worker.

A slot pool bounds memory: at most ``slots`` incomplete chunks per job (a packet
for a new chunk beyond it is rejected as ``pool_full``; its worker retransmits)
and the shadows of the last ``slots`` completed chunks. ``epoch`` (random per
start) is stamped on every result, so workers detect a restarted aggregator.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

import numpy as np

from .packet import (
    DATA,
    FIXED,
    NATURAL,
    RESULT,
    STATS,
    STATS_REPLY,
    Packet,
    PacketError,
    build,
    parse,
)

__all__ = ["AggregatorServer", "natural_compress_integers"]

log = logging.getLogger("sparcml.ina")


def natural_compress_integers(
    total: np.ndarray, rng: np.random.Generator | None
) -> tuple[np.ndarray, int]:
    """8-bit natural codes of int64 ``total`` (units of ``2^e_min``); returns (codes, clipped).

    ``|S|`` in ``[2^a, 2^(a+1))`` rounds to ``2^(a+1)`` with probability
    ``(|S| - 2^a) / 2^a`` (unbiased), or to the nearer power with ``rng=None``.
    """
    mag = np.abs(total).astype(np.uint64)
    zero = mag == 0
    safe = np.where(zero, 1, mag)
    a = np.floor(np.log2(safe.astype(np.float64))).astype(np.int64)
    # log2 in float64 can be off by one for huge integers: fix with exact shifts
    a = np.where((np.uint64(1) << a.astype(np.uint64)) > safe, a - 1, a)
    a = np.where((np.uint64(1) << (a + 1).astype(np.uint64)) <= safe, a + 1, a)
    low = np.uint64(1) << a.astype(np.uint64)
    frac = (safe - low).astype(np.float64) / low.astype(np.float64)
    up = (rng.random(total.shape) < frac) if rng is not None else frac >= 0.5
    e = a + up.astype(np.int64)
    clipped = int((e > 63).sum())
    e = np.minimum(e, 63)
    sign = (total < 0).astype(np.int64)
    codes = (sign << 7) | (zero.astype(np.int64) << 6) | np.where(zero, 0, e)
    return codes.astype(np.uint8), clipped


@dataclass
class _Slot:
    acc: np.ndarray
    seen: set[int] = field(default_factory=set)


@dataclass
class _Job:
    workers: int
    mode: int
    count_of: dict[int, int] = field(default_factory=dict)
    slots: dict[int, _Slot] = field(default_factory=dict)
    shadows: collections.OrderedDict[int, bytes] = field(default_factory=collections.OrderedDict)
    addrs: dict[int, tuple[str, int]] = field(default_factory=dict)


class AggregatorServer:
    """The aggregator service on a UDP port (``port=0``: any free port, see ``address``).

    Args:
        host / port: where to listen (default 127.0.0.1, any port).
        slots: the slot pool per job (incomplete chunks and kept shadows).
        master_rounding: ``"stochastic"`` (unbiased) or ``"nearest"`` re-compression.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        slots: int = 512,
        master_rounding: str = "stochastic",
    ) -> None:
        if master_rounding not in ("stochastic", "nearest"):
            raise ValueError(
                f"master_rounding must be stochastic or nearest, got {master_rounding!r}"
            )
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((host, port))
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.slots = slots
        self.master_rounding = master_rounding
        self.epoch = int.from_bytes(os.urandom(4), "little") or 1
        self.jobs: dict[int, _Job] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ service
    def start(self) -> AggregatorServer:
        self._thread = threading.Thread(target=self.serve_forever, name="sparcml-ina", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sock.close()

    def __enter__(self) -> AggregatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                buf, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            self.handle(buf, addr)

    def snapshot(self) -> dict[str, int]:
        """The counters (packets, bytes, results, duplicates, retransmissions, rejects)."""
        with self._lock:
            return dict(self.counters)

    # ------------------------------------------------------------------ packets
    def _reject(self, reason: str, detail: str, addr: tuple[str, int]) -> None:
        self.counters["rejected"] += 1
        self.counters[f"rejected_{reason}"] += 1
        n = self.counters[f"rejected_{reason}"]
        if n <= 10 or n % 1000 == 0:  # a flood of garbage must not flood the log
            log.warning("rejected a packet from %s:%s: %s: %s (%d so far)", addr[0], addr[1],
                        reason, detail, n)  # fmt: skip

    def handle(self, buf: bytes, addr: tuple[str, int]) -> None:
        with self._lock:
            self.counters["packets"] += 1
            self.counters["bytes"] += len(buf)
            try:
                p = parse(buf)
            except PacketError as e:
                self._reject(e.reason, e.detail, addr)
                return
            if p.kind == STATS:
                self._send(self._stats(p.job), addr)
                return
            if p.kind != DATA:
                self._reject("bad_kind", f"a {p.kind} packet sent to the aggregator", addr)
                return
            self._data(p, addr)

    def _data(self, p: Packet, addr: tuple[str, int]) -> None:
        job = self.jobs.get(p.job)
        if job is None:
            job = self.jobs[p.job] = _Job(p.workers, p.mode)
        if p.workers != job.workers or p.mode != job.mode:
            self._reject("job_mismatch", f"job {p.job} has {job.workers} workers, mode "
                         f"{job.mode}; packet says {p.workers}, {p.mode}", addr)  # fmt: skip
            return
        job.addrs[p.worker] = addr
        # Step 2: a complete chunk answers from its shadow copy.
        shadow = job.shadows.get(p.chunk)
        if shadow is not None:
            self.counters["retransmissions"] += 1
            self._send(shadow, addr)
            return
        known = job.count_of.get(p.chunk)
        if known is not None and known != p.count:
            self._reject(
                "count_mismatch", f"chunk {p.chunk}: {p.count} values, others {known}", addr
            )
            return
        slot = job.slots.get(p.chunk)
        if slot is None:
            if len(job.slots) >= self.slots:
                self._reject("pool_full", f"job {p.job}: {self.slots} chunks in flight", addr)
                return
            slot = job.slots[p.chunk] = _Slot(np.zeros(p.count, dtype=np.int64))
            job.count_of[p.chunk] = p.count
        # Step 3: never count a worker twice.
        if p.worker in slot.seen:
            self.counters["duplicates"] += 1
            return
        # Step 4: integers by shifts, then add.
        if p.mode == NATURAL:
            c = np.frombuffer(p.payload, dtype=np.uint8).astype(np.int64)
            offset = c & 63
            bound = 62 - max(0, (job.workers - 1).bit_length())
            if int(offset.max()) > bound:
                self._reject("overflow", f"exponent offset {int(offset.max())} > {bound} for "
                             f"{job.workers} workers", addr)  # fmt: skip
                return
            vals = np.where((c >> 6) & 1, 0, np.int64(1) << offset)
            vals = np.where((c >> 7) & 1, -vals, vals)
        else:
            vals = np.frombuffer(p.payload, dtype=">i4").astype(np.int64)
        slot.acc += vals
        slot.seen.add(p.worker)
        self.counters["values"] += p.count
        # Step 5: complete: re-compress, keep the shadow, send to every worker.
        if len(slot.seen) == job.workers:
            if p.mode == NATURAL:
                rng = (
                    np.random.default_rng([p.job, p.chunk])
                    if self.master_rounding == "stochastic"
                    else None
                )
                codes, clipped = natural_compress_integers(slot.acc, rng)
                self.counters["clipped"] += clipped
                payload = codes.tobytes()
            else:
                payload = slot.acc.astype(">i8").tobytes()
            out = build(Packet(RESULT, p.job, self.epoch, 0, job.workers, p.chunk, p.mode,
                               p.count, payload))  # fmt: skip
            del job.slots[p.chunk]
            job.shadows[p.chunk] = out
            while len(job.shadows) > self.slots:
                job.shadows.popitem(last=False)
            self.counters["results"] += 1
            for w in range(job.workers):
                self._send(out, job.addrs[w])

    def _stats(self, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        missing = {}
        if job is not None:
            for chunk, slot in list(job.slots.items())[:16]:
                missing[str(chunk)] = sorted(set(range(job.workers)) - slot.seen)
        body = json.dumps({"epoch": self.epoch, "counters": dict(self.counters),
                           "missing": missing}).encode()  # fmt: skip
        return build(Packet(STATS_REPLY, job_id, self.epoch, 0, 1, 0, FIXED, 0, body))

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            self.sock.sendto(data, addr)
            self.counters["sent_packets"] += 1
            self.counters["sent_bytes"] += len(data)
        except OSError as e:
            self.counters["send_errors"] += 1
            log.warning("send to %s failed: %s", addr, e)
