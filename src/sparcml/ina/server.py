"""The aggregator: an integer-only adder emulating a SwitchML-style switch (paper 004 App. A).

Paper 004 (appendix A): workers send chunks of 8-bit natural codes; "for a given
chunk, the aggregator awaits all values from every worker; then, it restores the
compressed values as integers, aggregates them and applies compression to
quantize the aggregated values", in 64-bit integers, and multicasts the result
back. SwitchML adds a slot pool and shadow copies for loss recovery. Both trust
the network and serve one job; sparcml's aggregator serves many *sessions*
(:mod:`~sparcml.ina.session`) on a shared, untrusted network, with bounded state.

Per session and chunk it keeps a slot: an int64 accumulator and the set of
members already counted. For each ``DATA`` packet:

1. check it (:func:`~sparcml.ina.packet.parse`; rejects are counted by reason
   and logged, rate-limited; the service goes on);
2. find its session by token; an unknown token creates one (if there is room)
   with the membership the packet declares (workers, mode) — with a secret, only
   if the packet's tag verifies under the session key derived from it; a packet
   of a known session must match that membership and, in a keyed session, carry
   a valid tag (``not_member``, ``bad_mac``, ``mac_required``, ``no_key``);
3. if the chunk is complete already, answer from the slot's **shadow copy** of
   the result when the packet is a retransmission (the worker lost the result:
   SwitchML's recovery; its call nonce is the one counted); the same chunk sent
   by another call (a new nonce: the call number was used twice, say after a
   checkpoint rewound the counter) is ``replayed``, and a chunk of an earlier
   call with no shadow is ``stale``: both are refused with a ``REFUSED`` packet
   naming the reason, so the worker raises at once, and never get an earlier
   call's sum (sparcml's addition: a result is bound to its session, call and
   the calls that made it, as SwitchML's and ATP's slots are bound to a round);
4. if this member was counted for the chunk already, drop it (duplicate), or
   refuse it when it comes from another call (``replayed``);
5. restore integers: natural codes become ``±2^offset`` (units of ``2^e_min``) by
   a shift, fixed-point values are already integers; add them (int64);
6. when all members are in: the result — ``FIXED``: the int64 sums; ``NATURAL``:
   the sum re-compressed to 8-bit codes (master-side compression, stochastic
   from a generator seeded by (session, chunk), or nearest) — is kept as the
   shadow copy and sent to every member (tagged in a keyed session).

Bounded state (none of it is in the paper, whose aggregator serves one trusted
job): at most ``max_sessions`` sessions (a new one evicts an *unproven* session
— none of whose chunks was completed by two or more members —, the one with the
fewest members heard from and then the least recently active, or is rejected as
``sessions_full``); at most ``slots`` incomplete
chunks per session and ``max_slots`` in all (``pool_full``; the worker
retransmits); at most ``slots`` shadows per session, and only of its current
and previous call (chunk ids are ``call * 2^32 + index`` and a member starts call
``c + 1`` only once every chunk of call ``c`` is complete, so when call ``c + 1``
appears no member can still need a shadow of call ``c - 1``). A shadow dropped
for room (more than ``slots`` complete chunks in a call: ``slots`` below the
workers' window) is remembered (the last ``EVICTED_KEPT`` per session), so that a
member's retransmission of it is refused as ``evicted``, naming ``slots``, instead
of opening a slot that no other member will fill. Idle sessions
expire after ``session_timeout`` seconds, incomplete slots after
``slot_timeout`` (their members still hold the chunk as outstanding and resend
it). Nothing is kept per chunk once its shadow is gone. ``state_bytes`` (in
:meth:`AggregatorServer.snapshot`) counts the accumulators and shadows held;
:attr:`AggregatorServer.state_bound` is its ceiling.

``STATS`` requests are answered with at most as many bytes as they carry (the
requester pads; there is no amplification): the global counters for anyone,
plus the session's incomplete chunks and missing members for a member of it.
``epoch`` (random per start) is stamped on every result, so workers detect a
restarted aggregator.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .packet import (
    DATA,
    FIXED,
    FLAG_MAC,
    HEADER,
    MAX_COUNT,
    MAX_WORKERS,
    NATURAL,
    REFUSED,
    RESULT,
    STATS,
    STATS_REPLY,
    TAG_BYTES,
    WINDOW,
    Packet,
    PacketError,
    build,
    parse,
    session_key,
    verify,
)

__all__ = ["AggregatorServer", "natural_compress_integers", "worker_ranges"]

log = logging.getLogger("sparcml.ina")

Address = tuple[str, int]
#: dropped shadows remembered per session, to refuse their retransmissions clearly
EVICTED_KEPT = 4096

# the counters a stranger's small STATS reply keeps first
_CORE = ("packets", "results", "rejected", "sessions", "slots")


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


def worker_ranges(workers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (compact lists of missing members)."""
    out: list[str] = []
    i = 0
    while i < len(workers):
        j = i
        while j + 1 < len(workers) and workers[j + 1] == workers[j] + 1:
            j += 1
        out.append(str(workers[i]) if i == j else f"{workers[i]}-{workers[j]}")
        i = j + 1
    return ",".join(out)


@dataclass
class _Slot:
    acc: np.ndarray
    touched: float
    seen: dict[int, int] = field(default_factory=dict)  # member -> its call nonce


@dataclass
class _Shadow:
    """A complete chunk's result, bound to the calls (nonces) that made it."""

    out: bytes
    nonces: dict[int, int]

    @property
    def nbytes(self) -> int:
        return len(self.out) + 8 * len(self.nonces)


@dataclass
class _Session:
    token: int
    workers: int
    mode: int
    key: bytes | None
    touched: float
    call: int = -1  # the highest call seen
    completed: int = 0  # chunks completed
    slots: dict[int, _Slot] = field(default_factory=dict)
    shadows: collections.OrderedDict[int, _Shadow] = field(default_factory=collections.OrderedDict)
    addrs: dict[int, Address] = field(default_factory=dict)
    #: chunks of the current and previous call whose shadows were dropped for room
    #: (each with its members' call nonces, as the shadow had them)
    evicted: collections.OrderedDict[int, dict[int, int]] = field(
        default_factory=collections.OrderedDict
    )
    #: chunks refused as a whole (members' counts differ, an overflow): the reason,
    #: for every member that sends them later (the last 1,024)
    doomed: collections.OrderedDict[int, str] = field(default_factory=collections.OrderedDict)

    @property
    def proven(self) -> bool:
        return self.completed > 0 and self.workers > 1


class AggregatorServer:
    """The aggregator service on a UDP port (``port=0``: any free port, see ``address``).

    Args:
        host / port: where to listen (default 127.0.0.1, any port).
        slots: incomplete chunks per session, and shadows kept per session.
        master_rounding: ``"stochastic"`` (unbiased) or ``"nearest"`` re-compression.
        max_sessions: sessions held at once.
        max_slots: incomplete chunks held at once, over all sessions.
        session_timeout / slot_timeout: seconds after which an idle session / an
            incomplete chunk that received nothing is dropped.
        secret: the aggregator's secret (1..64 bytes): every session is then keyed
            (:func:`~sparcml.ina.packet.session_key`) and untagged packets are
            rejected. ``None``: token mode, tagged packets are rejected.
        clock: the time source (seconds; tests pass a fake one).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        slots: int = 512,
        master_rounding: str = "stochastic",
        *,
        max_sessions: int = 16,
        max_slots: int = 4096,
        session_timeout: float = 300.0,
        slot_timeout: float = 60.0,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if master_rounding not in ("stochastic", "nearest"):
            raise ValueError(
                f"master_rounding must be stochastic or nearest, got {master_rounding!r}"
            )
        if slots < 1 or max_sessions < 1 or max_slots < 1:
            raise ValueError(
                f"slots, max_sessions and max_slots must be >= 1, got {slots}, "
                f"{max_sessions}, {max_slots}"
            )
        if not session_timeout > 0 or not slot_timeout > 0:
            raise ValueError("session_timeout and slot_timeout must be > 0")
        if secret is not None and not 1 <= len(secret) <= 64:
            raise ValueError(f"the secret must be 1..64 bytes, got {len(secret)}")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((host, port))
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.slots = slots
        if slots < WINDOW:
            log.warning("aggregator slots=%d is below the workers' default window (%d): a "
                        "result lost on its way back may be dropped before it is resent, and "
                        "that worker's call refused as 'evicted'", slots, WINDOW)  # fmt: skip
        self.max_sessions, self.max_slots = max_sessions, max_slots
        self.session_timeout, self.slot_timeout = float(session_timeout), float(slot_timeout)
        self.master_rounding = master_rounding
        self.secret = secret
        self.clock = clock
        self.epoch = int.from_bytes(os.urandom(4), "little") or 1
        self.sessions: dict[int, _Session] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._nslots = 0
        self._state_bytes = 0
        self._last_sweep = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state_bound(self) -> int:
        """The most bytes of accumulators and shadows this aggregator can hold."""
        shadow = HEADER.size + MAX_COUNT * 8 + TAG_BYTES + 8 * MAX_WORKERS
        return self.max_slots * MAX_COUNT * 8 + self.max_sessions * self.slots * shadow

    # ------------------------------------------------------------------ service
    @property
    def serving(self) -> bool:
        """Whether the serving thread runs (False before :meth:`start`, after
        :meth:`stop`, or when its socket failed)."""
        return self._thread is not None and self._thread.is_alive()

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
                with self._lock:
                    self._maybe_sweep(self.clock())
                continue
            except OSError:
                if not self._stop.is_set():
                    log.error("ina aggregator: its socket failed, serving stopped", exc_info=True)
                return
            try:
                self.handle(buf, addr)
            except Exception:  # one packet's bug must not stop the service for every job
                self.counters["handler_errors"] += 1
                log.exception("ina aggregator: a packet from %s raised; service goes on", addr)

    def snapshot(self) -> dict[str, int]:
        """The counters (packets, bytes, results, duplicates, retransmissions, rejects by
        reason, sessions created/expired/evicted, slots expired) and the state held
        now: ``sessions``, ``slots`` (incomplete chunks), ``shadows``, ``state_bytes``."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, int]:
        out = dict(self.counters)
        out["sessions"] = len(self.sessions)
        out["slots"] = self._nslots
        out["shadows"] = sum(len(s.shadows) for s in self.sessions.values())
        out["state_bytes"] = self._state_bytes
        return out

    # ------------------------------------------------------------------ state
    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep >= min(1.0, self.slot_timeout / 4):
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Drop idle sessions and incomplete chunks that received nothing for too long."""
        self._last_sweep = now
        for token, s in list(self.sessions.items()):
            if now - s.touched > self.session_timeout:
                self._drop_session(token)
                self.counters["sessions_expired"] += 1
                continue
            for chunk, slot in list(s.slots.items()):
                if now - slot.touched > self.slot_timeout:
                    self._drop_slot(s, chunk)
                    self.counters["slots_expired"] += 1

    def _doom(self, s: _Session, p: Packet, addr: Address, reason: str, detail: str) -> None:
        """Refuse ``p``'s chunk as a whole: its sender, the members that sent it already
        (its slot dropped) and every member that sends it later are told why."""
        slot = s.slots.get(p.chunk)
        waiting = {}
        if slot is not None:
            waiting = {w: s.addrs[w] for w in slot.seen if w in s.addrs and w != p.worker}
            self._drop_slot(s, p.chunk)
        s.doomed[p.chunk] = f"{reason}: {detail}"
        while len(s.doomed) > 1024:
            s.doomed.popitem(last=False)
        self._refuse(s, p, addr, reason, detail, others=waiting)

    def _drop_slot(self, s: _Session, chunk: int) -> None:
        slot = s.slots.pop(chunk)
        self._nslots -= 1
        self._state_bytes -= slot.acc.nbytes

    def _drop_shadow(self, s: _Session, chunk: int | None = None) -> None:
        if chunk is None:
            _, out = s.shadows.popitem(last=False)
        else:
            out = s.shadows.pop(chunk)
        self._state_bytes -= out.nbytes

    def _drop_session(self, token: int) -> None:
        s = self.sessions.pop(token)
        for chunk in list(s.slots):
            self._drop_slot(s, chunk)
        while s.shadows:
            self._drop_shadow(s)

    def _room_for_session(self, now: float) -> bool:
        if len(self.sessions) < self.max_sessions:
            return True
        self._sweep(now)
        if len(self.sessions) < self.max_sessions:
            return True
        unproven = [s for s in self.sessions.values() if not s.proven]
        if not unproven:
            return False
        # the fewest members heard from first (a flood's sessions have one), then the oldest
        victim = min(unproven, key=lambda s: (len(s.addrs), s.touched))
        self._drop_session(victim.token)
        self.counters["sessions_evicted"] += 1
        return True

    def _advance(self, s: _Session, call: int) -> None:
        """Call ``call`` started: shadows before the previous call and any incomplete
        chunk of an earlier call can no longer be needed by a member."""
        s.call = call
        while s.shadows and (next(iter(s.shadows)) >> 32) < call - 1:
            self._drop_shadow(s)
        while s.evicted and (next(iter(s.evicted)) >> 32) < call - 1:
            s.evicted.popitem(last=False)
        for chunk in [c for c in s.slots if (c >> 32) < call]:
            self._drop_slot(s, chunk)

    # ------------------------------------------------------------------ packets
    def _reject(self, reason: str, detail: str, addr: Address) -> None:
        self.counters["rejected"] += 1
        self.counters[f"rejected_{reason}"] += 1
        n = self.counters[f"rejected_{reason}"]
        if n <= 10 or n % 1000 == 0:  # a flood of garbage must not flood the log
            log.warning("rejected a packet from %s:%s: %s: %s (%d so far)", addr[0], addr[1],
                        reason, detail, n)  # fmt: skip

    def handle(self, buf: bytes, addr: Address) -> None:
        with self._lock:
            self.counters["packets"] += 1
            self.counters["bytes"] += len(buf)
            now = self.clock()
            self._maybe_sweep(now)
            try:
                p = parse(buf)
            except PacketError as e:
                self._reject(e.reason, e.detail, addr)
                return
            if p.kind == STATS:
                self._stats(p, buf, addr)
                return
            if p.kind != DATA:
                self._reject("bad_kind", f"a {p.kind} packet sent to the aggregator", addr)
                return
            self._data(p, buf, addr, now)

    def _authentic(self, p: Packet, buf: bytes, key: bytes | None, addr: Address) -> bool:
        if key is None:
            if p.flags & FLAG_MAC:
                self._reject("no_key", "a tagged packet, but this aggregator has no secret", addr)
                return False
            return True
        if not p.flags & FLAG_MAC:
            self._reject("mac_required", "an untagged packet for a keyed session", addr)
            return False
        if not verify(buf, key):
            self._reject("bad_mac", f"session {p.session:#x}: the tag does not verify", addr)
            return False
        return True

    def _session(self, p: Packet, buf: bytes, addr: Address, now: float) -> _Session | None:
        """Step 2: the packet's session, if it is an authentic member's packet."""
        s = self.sessions.get(p.session)
        if s is None:
            key = session_key(self.secret, p.session, p.workers, p.mode) if self.secret else None
            if not self._authentic(p, buf, key, addr):
                return None
            if not self._room_for_session(now):
                self._reject("sessions_full", f"{self.max_sessions} sessions, all active", addr)
                return None
            s = self.sessions[p.session] = _Session(p.session, p.workers, p.mode, key, now)
            self.counters["sessions_created"] += 1
            return s
        if not self._authentic(p, buf, s.key, addr):
            return None
        if p.workers != s.workers or p.mode != s.mode:
            self._reject("not_member", f"session {p.session:#x} has {s.workers} workers, mode "
                         f"{s.mode}; packet says worker {p.worker} of {p.workers}, mode {p.mode}",
                         addr)  # fmt: skip
            return None
        return s

    def _data(self, p: Packet, buf: bytes, addr: Address, now: float) -> None:
        s = self._session(p, buf, addr, now)
        if s is None:
            return
        s.touched = now
        # Step 3: a complete chunk answers a retransmission (the same call nonce) from
        # its shadow copy; the same chunk from another call (a call number used twice)
        # and a chunk of an earlier call are refused, never answered with an old sum.
        doomed = s.doomed.get(p.chunk)
        if doomed is not None:  # refused as a whole: every member is told
            reason, _, detail = doomed.partition(": ")
            self._refuse(s, p, addr, reason, detail)
            return
        shadow = s.shadows.get(p.chunk)
        call = p.chunk >> 32
        # (a shadow dropped for room keeps its nonces: its chunk is complete too)
        nonces = shadow.nonces if shadow is not None else s.evicted.get(p.chunk)
        if nonces is not None:
            if nonces.get(p.worker) != p.epoch:
                self._refuse(s, p, addr, "replayed", f"call {call} of this session is complete "
                             "already: a call number used twice (a rewound counter or a "
                             "restored checkpoint?); open a new session")  # fmt: skip
            elif shadow is not None:
                self.counters["retransmissions"] += 1
                self._send(shadow.out, addr)
            else:
                self._refuse(s, p, addr, "evicted", f"chunk {p.chunk:#x} is complete, but its "
                             f"result was dropped for room (the aggregator keeps {self.slots} "
                             "per session) before this worker had it: start the aggregator "
                             f"with --slots at least the workers' window ({WINDOW} by "
                             "default)")  # fmt: skip
            return
        if call < s.call:
            self._refuse(s, p, addr, "stale", f"chunk {p.chunk:#x} of call {call}, the session "
                         f"is at call {s.call}: calls of a session only go forward")  # fmt: skip
            return
        if call > s.call:
            self._advance(s, call)
        slot = s.slots.get(p.chunk)
        if slot is not None and slot.acc.size != p.count:
            # the members disagree on the tensor's size: none of them gets a sum, and
            # each is told at once (else every one retransmits until its timeout)
            detail = (f"chunk {p.chunk:#x}: worker {p.worker} sent {p.count} values, workers "
                      f"{sorted(slot.seen)} {slot.acc.size}: the workers' tensors differ in "
                      "size")  # fmt: skip
            self._doom(s, p, addr, "count_mismatch", detail)
            return
        if slot is not None and p.worker in slot.seen:  # Step 4: never count a member twice
            if slot.seen[p.worker] != p.epoch:  # the chunk again, from another call
                self._refuse(s, p, addr, "replayed", f"worker {p.worker} sent chunk "
                             f"{p.chunk:#x} from two calls: a call number used twice; open a "
                             "new session")  # fmt: skip
                return
            self.counters["duplicates"] += 1
            return
        # Step 5: integers by shifts.
        if p.mode == NATURAL:
            c = np.frombuffer(p.payload, dtype=np.uint8).astype(np.int64)
            offset = c & 63
            bound = 62 - max(0, (s.workers - 1).bit_length())
            if int(offset.max()) > bound:
                self._doom(s, p, addr, "overflow", f"chunk {p.chunk:#x}: exponent offset "
                           f"{int(offset.max())} > {bound} for {s.workers} workers")  # fmt: skip
                return
            vals = np.where((c >> 6) & 1, 0, np.int64(1) << offset)
            vals = np.where((c >> 7) & 1, -vals, vals)
        else:
            vals = np.frombuffer(p.payload, dtype=">i4").astype(np.int64)
        if slot is None:
            if len(s.slots) >= self.slots or self._nslots >= self.max_slots:
                self._reject("pool_full", f"session {p.session:#x}: {len(s.slots)} of "
                             f"{self.slots} chunks in flight, {self._nslots} of "
                             f"{self.max_slots} in all", addr)  # fmt: skip
                return
            slot = s.slots[p.chunk] = _Slot(np.zeros(p.count, dtype=np.int64), now)
            self._nslots += 1
            self._state_bytes += slot.acc.nbytes
        slot.acc += vals
        slot.seen[p.worker] = p.epoch
        slot.touched = now
        s.addrs[p.worker] = addr  # only a counted (authentic, new) packet moves an address
        self.counters["values"] += p.count
        # Step 6: complete: re-compress, keep the shadow, send to every member.
        if len(slot.seen) == s.workers:
            if p.mode == NATURAL:
                rng = (
                    np.random.default_rng([p.session, p.chunk])
                    if self.master_rounding == "stochastic"
                    else None
                )
                codes, clipped = natural_compress_integers(slot.acc, rng)
                self.counters["clipped"] += clipped
                payload = codes.tobytes()
            else:
                payload = slot.acc.astype(">i8").tobytes()
            out = build(Packet(RESULT, p.session, self.epoch, 0, s.workers, p.chunk, p.mode,
                               p.count, payload), s.key)  # fmt: skip
            self._drop_slot(s, p.chunk)
            shadow = s.shadows[p.chunk] = _Shadow(out, dict(slot.seen))
            self._state_bytes += shadow.nbytes
            while len(s.shadows) > self.slots:
                oldest = next(iter(s.shadows))
                s.evicted[oldest] = s.shadows[oldest].nonces
                self._drop_shadow(s)
                while len(s.evicted) > EVICTED_KEPT:
                    s.evicted.popitem(last=False)
            s.completed += 1
            self.counters["results"] += 1
            for w in range(s.workers):
                self._send(out, s.addrs[w])

    def _refuse(
        self,
        s: _Session,
        p: Packet,
        addr: Address,
        reason: str,
        detail: str,
        others: dict[int, Address] | None = None,
    ) -> None:
        """Reject ``p`` and tell its sender why (a ``REFUSED`` packet, tagged in a keyed
        session), so that the worker raises at once instead of retransmitting; a
        refusal of the whole chunk goes to the members in ``others`` too (worker ->
        address: those waiting for that chunk's result)."""
        self._reject(reason, f"session {p.session:#x}: {detail}", addr)
        # never longer than the refused packet's payload (but the reason's name):
        # no amplification towards a forged source
        text = f"{reason}: {detail}".encode()[: max(len(p.payload), len(reason))]
        for worker, to in [(p.worker, addr), *(others or {}).items()]:
            self._send(build(Packet(REFUSED, p.session, self.epoch, worker, s.workers, p.chunk,
                                    p.mode, len(text), text), s.key), to)  # fmt: skip

    # ------------------------------------------------------------------ stats
    def _stats(self, p: Packet, buf: bytes, addr: Address) -> None:
        """A reply no longer than the request; a member also learns its session's state."""
        s = self.sessions.get(p.session) if p.session else None
        member = (
            s is not None
            and p.workers == s.workers
            and p.worker < s.workers
            and bool(p.flags & FLAG_MAC) == (s.key is not None)
            and (s.key is None or verify(buf, s.key))
        )
        key = s.key if member and s is not None else None
        budget = len(buf) - HEADER.size - (TAG_BYTES if key is not None else 0)
        body: dict[str, object] = {"epoch": self.epoch, "counters": self._snapshot()}
        if member and s is not None:
            waiting: set[int] = set()
            everyone = set(range(s.workers))
            for slot in list(s.slots.values())[:64]:
                waiting |= everyone - slot.seen.keys()
            body["session"] = {"workers": s.workers, "call": s.call, "incomplete": len(s.slots),
                               "shadows": len(s.shadows),
                               "missing": worker_ranges(sorted(waiting))}  # fmt: skip
        payload = _fit(body, budget)
        self.counters["stats_replies"] += 1
        token = p.session if member else 0
        self._send(build(Packet(STATS_REPLY, token, self.epoch, 0, 1, 0, FIXED, 0, payload), key),
                   addr)  # fmt: skip

    def _send(self, data: bytes, addr: Address) -> None:
        try:
            self.sock.sendto(data, addr)
            self.counters["sent_packets"] += 1
            self.counters["sent_bytes"] += len(data)
        except OSError as e:
            self.counters["send_errors"] += 1
            log.warning("send to %s failed: %s", addr, e)


def _fit(body: dict[str, object], budget: int) -> bytes:
    """``body`` as JSON in at most ``budget`` bytes: dropping counters but the core ones,
    then the missing members' list, then everything (an empty payload)."""
    out = json.dumps(body, separators=(",", ":")).encode()
    if len(out) <= budget:
        return out
    counters = body["counters"]
    assert isinstance(counters, dict)
    body["counters"] = {k: counters[k] for k in _CORE if k in counters}
    out = json.dumps(body, separators=(",", ":")).encode()
    if len(out) <= budget:
        return out
    session = body.get("session")
    if isinstance(session, dict):
        session["missing"] = "?"
        out = json.dumps(body, separators=(",", ":")).encode()
        if len(out) <= budget:
            return out
    return b""
