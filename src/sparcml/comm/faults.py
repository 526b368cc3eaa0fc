"""Naming the rank that failed first: an abort record in the process group's store.

When a rank fails, its neighbours notice first, and the ranks waiting on those
neighbours notice only when the neighbours give up. Without help, a survivor
names whoever it happened to wait for, a live rank as often as not. So every
rank that learns the root cause publishes it in the torch.distributed store the
ranks share (the rendezvous ``TCPStore``), and every rank that gives up reads
it before naming anyone:

* a rank whose own code raised (a non-communication error inside a sparcml
  call) publishes ``rank r raised ...`` before the error leaves sparcml;
* a rank that sees a peer's connection close (direct evidence that the peer
  died) publishes ``rank p died``, unless a record exists already or the peer
  reports, within a moment, that it gave up waiting itself (then the chain of
  waits is followed, as below);
* a rank that times out publishes what it was waiting for (``stuck/<rank>``),
  then follows the chain of waits through the other ranks' reports for a grace
  period: the first rank in the chain that reports nothing is the one that
  stopped (frozen, hung or absent), and is published as the root cause. With no
  known peer (a dense collective), the ranks that report nothing are.

The first record wins (``compare_set``); each survivor raises
:class:`~sparcml.errors.PeerFailedError` (died or raised) or
:class:`~sparcml.errors.CommTimeoutError` (stopped answering) whose ``peer`` is
the recorded rank, and says which rank it was itself waiting for.

If the store itself is unreachable, the rank that hosts it (rank 0 under
``init_method="tcp://..."`` or ``env://`` without torchrun's agent store) is
presumed dead. Records are kept per process group (keys prefixed with the
group's name). A rank's own error is recorded for its collective call (the
call's number, which every rank counts alike): an error every rank raised alike
leaves the communicator usable, and a later call's failure must not be blamed on
it. A death, a freeze and the ranks' reports of whom they wait for break the
communicator, and stay readable from any call (a rank that moved on to the next
call may wait on one still stuck in the last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CommError, CommTimeoutError, PeerFailedError
from .abort import is_uniform

__all__ = [
    "FailureRecord",
    "StoreFaults",
    "is_local_failure",
    "make_error",
    "store_address",
    "store_client",
]

log = logging.getLogger("sparcml")
T = TypeVar("T")

_POLL_S = 0.05


def is_local_failure(exc: BaseException) -> bool:
    """True for an error that this rank raised and the others may not know of.

    Communication errors are already resolved; mismatches, NaN/Inf checks and other
    agreed errors are raised by every rank at once, unless marked otherwise (a
    mismatch only some ranks could see is marked non-uniform where it is found,
    :func:`sparcml.comm.abort.mark_uniform`).
    """
    return not isinstance(exc, CommError) and not is_uniform(exc)


@dataclasses.dataclass
class FailureRecord:
    """The root cause: ``rank`` failed (``kind``: died, error, timeout), as ``reporter`` saw it."""

    rank: int
    kind: str
    reporter: int
    reason: str

    def encode(self) -> str:
        return f"{self.rank}|{self.kind}|{self.reporter}|{self.reason}"

    @classmethod
    def decode(cls, text: str) -> FailureRecord | None:
        parts = text.split("|", 3)
        if len(parts) != 4 or not parts[0].isdigit() or not parts[2].isdigit():
            return None
        return cls(int(parts[0]), parts[1], int(parts[2]), parts[3])


def _classify(text: str) -> str:
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return "timeout"
    if any(w in low for w in ("closed", "reset", "broken", "refused", "eof", "shut down")):
        return "closed"
    return "other"


class StoreFaults:
    """The abort record of one process group (see the module docstring).

    Store operations run on a connection of their own, in a helper thread
    bounded by ``op_timeout``: a frozen store host must not freeze the ranks
    that ask it who failed. :meth:`warm` opens that connection ahead of any
    failure: opened only once a rank fails, it met a store host busy with the
    failure (a reset connection, retried after the client's timeout) and the
    rank named the failed peer seconds late.

    Args:
        connect: opens a ``torch.distributed.Store`` client (None: no store,
            local evidence only).
        prefix: key prefix unique to the group.
        rank / world_size: this rank in the group and the group's size.
        grace: seconds a timed-out rank waits for the other ranks' reports.
        store_host: the group rank whose process hosts the store, when known;
            it waits (up to ``linger`` seconds) for the others to read the record
            before raising, since its exit takes the store down.
    """

    def __init__(
        self,
        connect: Callable[[], Any] | None,
        prefix: str,
        rank: int,
        world_size: int,
        grace: float,
        store_host: int | None,
        linger: float = 0.0,
        op_timeout: float = 3.0,
        address: tuple[str, int] | None = None,
        collective_wait: float = 0.0,
    ) -> None:
        self._connect = connect
        self.store: Any = None
        self._opening = threading.Lock()  # one connection, opened once
        self._warming: threading.Thread | None = None
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.grace = grace
        self.store_host = store_host
        self.linger = linger
        self.op_timeout = op_timeout
        self._store_ok = connect is not None
        # how the store was lost: "timeout" (its host does not answer: frozen) or
        # "closed" (its port refuses connections: its host is gone)
        self._lost_kind = "closed"
        self.address = address
        # a dense collective (no known peer) whose connection closed: the others in
        # it give up only at their timeout, so their reports take up to this long
        self.collective_wait = collective_wait

    # ----------------------------------------------------------------- store access
    def _key(self, name: str, call: int | None = None) -> str:
        """The store key of ``name``: of collective call ``call``, or of the group."""
        return f"{self.prefix}/{name}" if call is None else f"{self.prefix}/c{call}/{name}"

    def _open(self) -> Any:
        """The store client, opened on first use (by :meth:`warm` or an operation)."""
        with self._opening:
            if self.store is None:
                assert self._connect is not None
                self.store = self._connect()
            return self.store

    def warm(self) -> None:
        """Open the store connection now, in the background, so that a failure's
        record is read and written at once; a failed attempt is left to the first
        operation, which tries again and counts it."""
        if self._connect is None or self.store is not None:
            return

        def run() -> None:
            try:
                self._open()
            except Exception as e:  # the first operation will try again
                log.debug("rank %d: store connection not opened ahead: %s", self.rank, e)

        thread = threading.Thread(target=run, name="sparcml-store-open", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # (no thread to spare: the first operation opens it)
            log.debug("rank %d: store connection not opened ahead: %s", self.rank, e)
            return
        self._warming = thread

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for :meth:`warm`'s connection attempt: a
        thread still inside the store client's C++ code when the interpreter
        finalizes can abort the process."""
        thread = self._warming
        if thread is not None:
            thread.join(timeout)

    def _op(self, fn: Callable[[Any], T]) -> T | None:
        """``fn(store)`` in a helper thread, at most ``op_timeout`` seconds; None if the
        store is (or turns out) unreachable."""
        if not self._store_ok:
            return None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = fn(self._open())
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name="sparcml-store", daemon=True)
        t.start()
        t.join(self.op_timeout)
        if t.is_alive() or "error" in box:
            self._lost(box.get("error", TimeoutError("no answer")))
            return None
        return box["out"]  # type: ignore[no-any-return]

    def _get(self, name: str, call: int | None = None) -> str | None:
        key = self._key(name, call)

        def get(store: Any) -> str | None:
            if not store.check([key]):
                return None
            return bytes(store.get(key)).decode("utf-8", "replace")

        return self._op(get)

    def _set(self, name: str, value: str) -> None:
        key = self._key(name)
        self._op(lambda store: store.set(key, value))

    def _lost(self, e: BaseException) -> None:
        log.debug("rank %d: store unreachable: %s", self.rank, e)
        if self._store_ok:
            self._lost_kind = self._probe(e)
        self._store_ok = False

    def _probe(self, e: BaseException) -> str:
        """Frozen or gone? The store's client retries a refused connection until its
        timeout, so its error reads "timed out" either way; a plain connection to the
        store's port tells: the kernel still accepts one for a frozen process (its
        listening socket lives), and refuses it once the process is gone."""
        if self.address is not None:
            try:
                with socket.create_connection(self.address, timeout=1.0):
                    return "timeout"
            except ConnectionRefusedError:
                return "closed"
            except OSError:
                return "timeout"
        frozen = isinstance(e, TimeoutError) or _classify(str(e)) == "timeout"
        return "timeout" if frozen else "closed"

    def read(self, call: int | None = None) -> FailureRecord | None:
        """The published root cause, if any: a death or freeze, or a rank's own error
        in collective call ``call``."""
        text = self._get("abort")
        if not text and call is not None:
            text = self._get("abort", call)
        return FailureRecord.decode(text) if text else None

    def publish(self, record: FailureRecord, call: int | None = None) -> FailureRecord:
        """Publish ``record`` (a rank's own error: for collective ``call``) unless one
        exists already; returns the one that holds."""
        key = self._key("abort", call)
        got = self._op(lambda store: bytes(store.compare_set(key, "", record.encode())))
        held = FailureRecord.decode(got.decode("utf-8", "replace")) if got else None
        return held if held is not None else record

    def record_local(self, exc: BaseException, call: int | None = None) -> None:
        """This rank's own code raised ``exc`` inside sparcml collective call ``call``:
        publish it."""
        if not is_local_failure(exc) or getattr(exc, "_sparcml_recorded", False):
            return
        with contextlib.suppress(Exception):  # exceptions without a __dict__
            exc._sparcml_recorded = True  # type: ignore[attr-defined]
        reason = f"raised {type(exc).__name__}: {exc}".replace("\n", " ")[:500]
        self.publish(FailureRecord(self.rank, "error", self.rank, reason), call)

    # ----------------------------------------------------------------- resolution
    def _reports(self) -> dict[int, int | None]:
        """Which ranks gave up waiting, and for whom (None: a collective, no one peer)."""
        keys = {r: self._key(f"stuck/{r}") for r in range(self.world_size) if r != self.rank}

        def read(store: Any) -> dict[int, str]:
            return {r: bytes(store.get(k)).decode() for r, k in keys.items() if store.check([k])}

        got = self._op(read) or {}
        return {r: (int(v) if v.isdigit() else None) for r, v in got.items()}

    def _peer_gave_up(self, peer: int, call: int | None) -> bool:
        """Whether ``peer`` reports waiting for someone (it is alive), within a moment.

        A live rank that times out may close its connections before its own report
        lands (seen once in 60 fault runs: P = 4, rank 3 frozen, rank 1 gave up on it,
        its closed connection made rank 0 publish "rank 1 died"). So a closed
        connection counts as death only if no report from that peer arrives within
        ``min(grace, 2 s)``; a peer that reports is followed like any other wait.
        """
        if not self._store_ok:
            return False
        deadline = time.monotonic() + min(self.grace, 2.0)
        while True:
            if peer in self._reports() or self.read(call) is not None:
                return True
            if time.monotonic() >= deadline or not self._store_ok:
                return False
            time.sleep(_POLL_S)

    def _store_host_record(self, what: str) -> FailureRecord | None:
        """The store's host as the root cause, once the store is lost: frozen (its
        store does not answer: ``CommTimeoutError``) or dead (it refuses or resets
        connections: ``PeerFailedError``), as the README's error table says."""
        if self.store_host is None or self.store_host == self.rank:
            return None
        if self._lost_kind == "timeout":
            return FailureRecord(self.store_host, "timeout", self.rank,
                                 f"stopped answering (it hosts the store, which does not answer "
                                 f"either) during {what}")  # fmt: skip
        return FailureRecord(
            self.store_host, "died", self.rank, f"is unreachable (it hosts the store) during {what}"
        )

    def resolve(
        self, error: Exception, peer: int | None, what: str, call: int | None = None
    ) -> FailureRecord:
        """The root cause of ``error``, seen by this rank while waiting for ``peer`` in
        ``what``, in collective call ``call`` (whose own-error records count)."""
        record = self._resolve(error, peer, what, call)
        self._set(f"seen/{self.rank}", _seen(call))
        if self.rank == self.store_host and self._store_ok and self.linger > 0:
            self._wait_for_readers(record, call)
        return record

    def acknowledge(self, origin: int, call: int | None = None) -> None:
        """This rank failed call ``call``, which ``origin`` failed first (an abort
        note): say so (the others learn from the notes themselves, on their way
        before the error leaves, so the store's host need not stay up for them)."""
        self._set(f"seen/{self.rank}", _seen(call))

    def _wait_for_readers(self, record: FailureRecord, call: int | None) -> None:
        """On the store's host: let the other survivors read the record of the
        failure of ``call`` before this process (and the store with it) goes away.
        A mark left by an earlier failure does not count: after an error every rank
        raised alike, the host once found the survivors' marks of that error, left
        at once, and a survivor slower to see a later death found the store gone
        and blamed its host."""
        others = [r for r in range(self.world_size) if r not in (self.rank, record.rank)]
        keys = [self._key(f"seen/{r}") for r in others]
        want = _seen(call).encode()

        def all_read(store: Any) -> bool:
            return all(store.check([k]) and bytes(store.get(k)) == want for k in keys)

        deadline = time.monotonic() + self.linger
        while time.monotonic() < deadline and self._store_ok:
            if self._op(all_read):
                return
            time.sleep(_POLL_S)

    def _resolve(
        self, error: Exception, peer: int | None, what: str, call: int | None
    ) -> FailureRecord:
        kind = _classify(str(error))
        held = self.read(call)
        if held is not None:
            return held
        if kind == "closed" and peer is not None:
            gave_up = self._peer_gave_up(peer, call)
            if not self._store_ok:
                # the store is gone too: the peer may only have given up on its host,
                # which is then the one to name (a frozen or dead rank 0)
                lost = self._store_host_record(what)
                if lost is not None:
                    return lost
            if not gave_up:
                # direct evidence: the peer's connection is gone, and it did not report
                # giving up itself
                return self.publish(
                    FailureRecord(peer, "died", self.rank, f"closed its connection during {what}")
                )
        self._set(f"stuck/{self.rank}", str(-1 if peer is None else peer))
        if not self._store_ok:
            lost = self._store_host_record(what)
            if lost is not None:
                return lost
            return FailureRecord(
                peer if peer is not None else -1,
                "died" if kind == "closed" else "timeout",
                self.rank,
                f"did not answer during {what}",
            )
        return self._follow(peer, kind, what, call)

    def _follow(self, peer: int | None, kind: str, what: str, call: int | None) -> FailureRecord:
        """Wait up to ``grace`` for the chain of waits to end at a rank that reports nothing.

        In a dense collective (no known peer) the ranks that report nothing are the
        suspects; with a closed connection as evidence, the others' reports may
        take up to their timeout (``collective_wait``), and the suspect is named
        dead as soon as it is the only rank without one."""
        closed_collective = kind == "closed" and peer is None
        wait = self.grace + (self.collective_wait if closed_collective else 0.0)
        deadline = time.monotonic() + wait
        while True:
            held = self.read(call)
            if held is not None:
                return held
            if not self._store_ok:
                lost = self._store_host_record(what)
                if lost is not None:
                    return lost
                break
            reports = self._reports()
            silent = [r for r in range(self.world_size) if r != self.rank and r not in reports]
            if time.monotonic() >= deadline or not silent:
                break
            if closed_collective and len(silent) == 1:
                break
            time.sleep(_POLL_S)
        verb = "stopped answering (no report from it)"
        if kind == "closed":
            verb = "closed its connection or stopped answering"
        if peer is not None:
            seen = {self.rank}
            x = peer
            while x in reports and x not in seen:
                seen.add(x)
                nxt = reports[x]
                if nxt is None:
                    break
                x = nxt
            if x not in reports:
                record = FailureRecord(x, "timeout", self.rank, f"{verb} during {what}")
            else:  # every rank on the chain is waiting: a cycle of live ranks
                record = FailureRecord(
                    peer, "timeout", self.rank,
                    f"is alive but waiting too (ranks wait on each other in a cycle: are "
                    f"they calling the same collectives in the same order?) during {what}",
                )  # fmt: skip
        elif silent:
            more = f" (no report from ranks {silent})" if len(silent) > 1 else ""
            died = closed_collective and len(silent) == 1
            record = FailureRecord(silent[0], "died" if died else "timeout", self.rank,
                                   f"{verb}{more} during {what}")  # fmt: skip
        else:
            return FailureRecord(-1, "timeout", self.rank, f"every rank gave up during {what}")
        return self.publish(record)


def make_error(
    record: FailureRecord, me: int, peer: int | None, what: str, cause: str, timeout: float
) -> CommError:
    """The error this rank raises for ``record``."""
    waited = f"rank {peer}" if peer is not None else "its peers"
    if record.rank < 0:
        return CommTimeoutError(
            f"rank {me}: timed out after {timeout:g}s in {what} waiting for {waited}; "
            f"no rank could be singled out: {cause}",
            peer=peer,
        )
    root = record.rank
    origin = "this rank" if root == me else f"rank {root}"
    seen = "" if record.reporter in (me, root) else f" (seen by rank {record.reporter})"
    blame = f"{origin} {record.reason}{seen}"
    if root == peer or peer is None:
        detail = f"rank {me}: {what} failed: {blame}"
    else:
        detail = f"rank {me}: {what} failed waiting for rank {peer}, because {blame}"
    detail += f" [{cause}]" if cause else ""
    cls = CommTimeoutError if record.kind == "timeout" else PeerFailedError
    return cls(detail, peer=root)


def agent_store() -> bool:
    """True under torchrun's agent store (the store does not live in rank 0)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def store_address(store: Any) -> tuple[str, int] | None:
    """The (host, port) of the TCP store under ``store``, if it is one."""
    import torch.distributed as dist

    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    return (inner.host, inner.port) if isinstance(inner, dist.TCPStore) else None


def store_client(store: Any, timeout: float) -> Callable[[], Any] | None:
    """A function opening a new client of the TCP store under ``store`` (unwrapping
    prefix stores), or reusing ``store`` when it is of another kind."""
    import datetime

    import torch.distributed as dist

    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        host, port = inner.host, inner.port
        td = datetime.timedelta(seconds=timeout)

        def connect() -> Any:
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=td)

        return connect
    return lambda: store


def _seen(call: int | None) -> str:
    """The value of a rank's ``seen`` mark: which failure it saw."""
    return f"call {call}"
