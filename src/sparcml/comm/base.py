"""The communicator interface: moves byte payloads whose size the receiver does not know.

SparCML's core difficulty (paper 000, sec. 5.2-5.3) is that the size of a
partially reduced sparse stream is unknown before it arrives. A backend therefore
only has to provide point-to-point sends and receives of 1-D ``uint8`` tensors of
any length (zero included) and dense collectives; everything else — all-to-all
with per-peer sizes, allgather with per-rank sizes — is built here once, on top
of those primitives, so every backend counts bytes the same way.

Backends:

* :class:`~sparcml.comm.local.LocalCommunicator` — in-process ranks (threads),
  for tests; see :func:`~sparcml.comm.local.run_ranks`.
* :class:`~sparcml.comm.torchdist.TorchDistCommunicator` — torch.distributed
  (gloo with CPU tensors, NCCL with CUDA tensors).
* :class:`SelfCommunicator` — a world of one, no process group needed.

Byte accounting (:class:`CommStats`): ``bytes_sent``/``bytes_recv`` count the
payload bytes of point-to-point messages, and for dense collectives delegated to
a backend library the bytes a ring algorithm moves per rank (documented in each
backend); ``control_bytes`` counts the 8-byte length prefixes of the
unknown-size protocol separately.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import CommError, RankMismatchError
from ..reinterpret import as_bytes, bytes_as, dense_1d
from .abort import AbortNote, is_uniform

__all__ = ["CommStats", "Communicator", "Handle", "SelfCommunicator"]


@dataclasses.dataclass
class CommStats:
    """Per-rank traffic counters. ``reset()`` zeroes them; ``snapshot()`` copies them."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    control_bytes: int = 0

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    def snapshot(self) -> CommStats:
        return dataclasses.replace(self)

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )


class Handle:
    """A pending point-to-point operation. ``wait()`` returns the received tensor (or None).

    ``progress``, where a backend gives one, moves the operation on without waiting
    for it to finish: a receive of unknown length over torch.distributed waits for
    the length and posts the body's receive, so that a caller expecting several
    messages has all their bodies in flight at once (:meth:`Communicator.alltoallv`).
    """

    def __init__(
        self,
        waiter: Callable[[], torch.Tensor | None],
        progress: Callable[[], None] | None = None,
        poll: Callable[[], bool] | None = None,
        owner: Handle | None = None,
    ) -> None:
        self._waiter: Callable[[], torch.Tensor | None] | None = waiter
        self._progress = progress
        self._poll = poll
        self._result: torch.Tensor | None = None
        # a receive posted in stages (length, then body) holds what waits for its
        # body's posting (:meth:`when_posted`); a wrapper's owner holds it
        self._owner = owner
        self._until_posted: list[Callable[[], None]] | None = None

    def defer_until_posted(self) -> None:
        """(Backends) this receive posts its body later, in :meth:`progress`; call
        :meth:`mark_posted` then."""
        self._until_posted = []

    def mark_posted(self) -> None:
        """(Backends) every part of this receive is posted: run what waited for it."""
        waiting, self._until_posted = self._until_posted, None
        for fn in waiting or ():
            fn()

    def when_posted(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this receive has every part posted with the transport: at
        once where it has, or where the backend posts a receive whole."""
        owner = self
        while owner._owner is not None:
            owner = owner._owner
        if owner._until_posted is None:
            fn()
        else:
            owner._until_posted.append(fn)

    def progress(self) -> None:
        """Move the operation on without waiting for its end (a no-op where the
        backend has nothing to start early)."""
        if self._progress is not None and self._waiter is not None:
            step, self._progress = self._progress, None
            step()

    @classmethod
    def done(cls, result: torch.Tensor | None = None) -> Handle:
        h = cls(lambda: result)
        h.wait()
        return h

    def wait(self) -> torch.Tensor | None:
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            self._result = waiter()
        return self._result

    def is_completed(self) -> bool:
        """Whether the operation is over: waited for, or (where the backend can tell
        without waiting) finished."""
        return self._waiter is None or (self._poll is not None and self._poll())


def check_payload(buf: torch.Tensor) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError("payloads are 1-D uint8 tensors")
    return buf.contiguous()


class Communicator(abc.ABC):
    """SPMD communication between ``world_size`` ranks.

    Subclasses implement :meth:`_isend`, :meth:`_irecv` and may override the
    dense collectives with faster native versions. All methods are blocking
    unless named ``i*``; a call that waits longer than :attr:`timeout` seconds
    for a peer raises :class:`~sparcml.errors.CommTimeoutError` naming it.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        timeout: seconds to wait for a peer before failing.
        stats: this rank's :class:`CommStats`.
        device: where received payloads land (``cpu`` for gloo and in-process).
    """

    rank: int
    world_size: int
    timeout: float
    device: torch.device
    #: The ranks agree on the rank that failed first (a shared store,
    #: :mod:`sparcml.comm.faults`), so a wait on a live rank that waits itself still
    #: names the failed one: collectives may then exchange in O(log P) rounds
    #: without losing who is to blame.
    agrees_on_failures: bool = False
    #: An exchange (both ranks of a pair send to each other at once) posts its
    #: receive before its send, and the send holds its body until that receive's
    #: body is posted (:meth:`isend`'s ``after``): gloo sends a body only after the
    #: receiver's "ready to receive" note, on the pair's one connection, in order
    #: (docs/cluster.md, "Exchanges over gloo"). False keeps the send first: NCCL
    #: runs a pair's operations in order on one stream, where a receive posted
    #: first would wait for a send queued behind it (not run on two GPUs here).
    receives_first: bool = True
    #: The ranks are threads of one process (in-process, simulated): one node unless
    #: a topology is set (:meth:`set_topology`).
    one_process: bool = False

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.stats = CommStats()
        self._engine: Any = None
        self._engine_lock = threading.Lock()
        self._sequence = 0
        self._control = 0
        self._call: int | None = None  # the collective call in progress (its number)
        self._call_traffic = False  # a message of that call was sent or received
        self._broken: str | None = None  # why this communicator refuses further use
        self._unsent_notes: list[Handle] = []  # abort notes no peer has taken yet
        self._topology: Any = None  # comm.topology.Topology, once set or detected
        self._groups: dict[tuple[int, ...], Any] = {}

    @contextlib.contextmanager
    def control(self) -> Iterator[None]:
        """Mark the messages sent inside as control traffic (metadata whose size does not
        grow with the vector). Real transports ignore the mark; the simulated one
        (:mod:`sparcml.comm.sim`) then does not scale their cost with the data."""
        self._control += 1
        try:
            yield
        finally:
            self._control -= 1

    @property
    def sequence(self) -> int:
        """The number of the last collective call (0 before the first); settable, for
        a resumed run that must continue the numbering (quantizers' seeds use it)."""
        return self._sequence

    @sequence.setter
    def sequence(self, value: int) -> None:
        self._sequence = int(value)

    def now(self) -> float:
        """Seconds on this rank's clock (the wall clock; the simulator's is virtual),
        for timing calls (``algorithm="auto"`` measures with it)."""
        return time.perf_counter()

    def next_sequence(self) -> int:
        """Number the collective calls: every rank calls them in the same order."""
        self._sequence += 1
        return self._sequence

    # ----------------------------------------------------------- node topology
    def node_key(self) -> str:
        """A name of this rank's node, equal for the ranks that share it: the
        launcher's node rank (``GROUP_RANK``) or the host name. MPI overrides it
        with its shared-memory split."""
        from .topology import node_identity

        return node_identity() or f"host:{socket.gethostname()}"

    @property
    def topology(self) -> Any:
        """The node layout of the ranks (:class:`~sparcml.comm.topology.Topology`):
        set with :meth:`set_topology`, or detected on first use, a collective every
        rank reaches at the same call (:func:`~sparcml.comm.topology.detect_topology`)."""
        if self._topology is None:
            from .topology import detect_topology

            self._topology = detect_topology(self)
        return self._topology

    @property
    def known_topology(self) -> Any:
        """The node layout if set or detected already, else None (no messages)."""
        return self._topology

    def set_topology(self, topology: Any) -> None:
        """Use ``topology`` (a :class:`~sparcml.comm.topology.Topology` of this world
        size, the same on every rank) instead of detecting it."""
        from .topology import Topology, TopologyError

        if not isinstance(topology, Topology):
            raise TypeError(f"expected a Topology, got {type(topology).__name__}")
        if topology.world_size != self.world_size:
            raise TopologyError(
                f"the topology places {topology.world_size} ranks, the communicator has "
                f"{self.world_size}"
            )
        self._topology = topology
        self._groups.clear()

    def subgroup(self, members: Sequence[int]) -> Communicator:
        """The ranks ``members`` (parent ranks, this rank among them; rank ``i`` of the
        group is ``members[i]``) as a communicator over this one's links
        (:class:`~sparcml.comm.topology.SubCommunicator`; cached, so its traffic
        counters persist)."""
        key = tuple(members)
        sub = self._groups.get(key)
        if sub is None:
            from .topology import SubCommunicator

            sub = self._groups[key] = SubCommunicator(self, key)
        return sub

    # ----------------------------------------------------------- failing alike
    @contextlib.contextmanager
    def in_call(self, number: int) -> Iterator[None]:
        """Run one collective call numbered ``number``: an error raised inside fails
        the call on every rank (:mod:`sparcml.comm.abort`)."""
        self.check_usable()
        outer = (self._call, self._call_traffic)
        self._call, self._call_traffic = number, False
        try:
            yield
        except BaseException as e:
            self.fail_call(e)
            raise
        finally:
            self._call, self._call_traffic = outer

    def fail_call(self, exc: BaseException) -> None:
        """This rank failed a call with ``exc``: unless every rank raises it alike,
        record it for the failure agreement and send every peer an abort note
        (once per error; see :mod:`sparcml.comm.abort`). Outside a call, the call the
        peers wait in is the next one, and this rank counts it as made."""
        if is_uniform(exc) or getattr(exc, "_sparcml_failed", False):
            return
        with contextlib.suppress(AttributeError):
            exc._sparcml_failed = True  # type: ignore[attr-defined]
        number = self._call if self._call is not None else self.next_sequence()
        note = AbortNote.of(number, self.rank, exc)
        if note.origin == self.rank:  # a forwarded note's origin recorded its own
            self.record_failure(exc, number)
        payload = torch.frombuffer(bytearray(note.encode()), dtype=torch.uint8)
        sends = []
        for peer in range(self.world_size):
            if peer != self.rank and peer != note.origin:
                with contextlib.suppress(Exception):  # a dead peer must not hide exc
                    sends.append(self._send_note(payload, peer))
        self._flush_notes(sends)
        with contextlib.suppress(Exception):
            self._after_failure(note.origin)
        if self._call is None or self._call_traffic or note.origin != self.rank:
            # messages of the abandoned call may still be in flight on some link
            self._broken = (
                f"call {number} failed ({note.error_type} on rank {note.origin}: "
                f"{note.message[:300]})"
            )

    #: seconds a failing rank waits for its abort notes to leave before its error does
    NOTE_FLUSH_S = 0.25

    def _flush_notes(self, sends: list[Handle]) -> None:
        """Let the abort notes leave before the error does (the process may exit on
        it), for at most :attr:`NOTE_FLUSH_S`. A transport may complete a send only
        once the peer posts its receive (gloo): a peer waiting on this rank takes its
        note at once; a peer that is failing too, or waiting on another rank, may
        never post one. So the notes are polled, never waited for: a wait would end
        only at the communicator's timeout, and a timed-out wait is itself a failure
        (gloo closes the group's connections, and the timeout would be resolved,
        naming a live rank). A note still unsent goes on in the background; its
        handle is kept until it completes."""
        deadline = time.monotonic() + self.NOTE_FLUSH_S
        pending = [h for h in sends if not h.is_completed()]
        while pending and time.monotonic() < deadline:
            time.sleep(0.002)
            pending = [h for h in pending if not h.is_completed()]
        self._unsent_notes = [h for h in self._unsent_notes if not h.is_completed()] + pending

    def _after_failure(self, origin: int) -> None:
        """After a failed call's notes are sent: backends whose failure record lives in
        one rank's process keep that process up until the others have seen it."""
        return None

    def failing_call(self) -> int:
        """The call a failure seen now belongs to: the call this rank is in, or
        between calls the next one (where a peer that failed outside a call counts
        its failure, :meth:`fail_call`)."""
        return self._call if self._call is not None else self._sequence + 1

    def _send_note(self, payload: torch.Tensor, dst: int) -> Handle:
        """Send an abort note to ``dst`` on the links the calls use, so that whatever
        receive ``dst`` has posted for this rank takes it. Backends without such
        links (a world of one, the simulator) send nothing."""
        return Handle.done()

    def check_usable(self) -> None:
        """Raise if a failed call left this communicator unusable (and let go of the
        abort notes that peers have taken since)."""
        if self._unsent_notes:
            self._unsent_notes = [h for h in self._unsent_notes if not h.is_completed()]
        if self._broken is not None:
            raise CommError(
                f"rank {self.rank}: this communicator cannot be used after {self._broken}: "
                "messages of that call may still be in flight; create a new communicator "
                "(a new process group)"
            )

    # ----------------------------------------------------------- backend primitives
    @abc.abstractmethod
    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:
        """Start sending ``buf`` (1-D uint8, possibly empty) to ``dst``."""

    @abc.abstractmethod
    def _irecv(self, src: int, tag: int) -> Handle:
        """Start receiving one message of unknown length from ``src``."""

    # ----------------------------------------------------------- point to point
    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank}: invalid {what} rank {peer} (world size {self.world_size})"
            )

    def isend(
        self, buf: torch.Tensor, dst: int, tag: int = 0, *, after: Handle | None = None
    ) -> Handle:
        """Non-blocking send of a 1-D uint8 tensor of any length to ``dst``.

        ``after``: this rank's receive of the message ``dst`` sends here at the same
        time without waiting for this one (an exchange), posted before this send. A
        backend whose transport moves two bodies crossing one connection one after
        the other holds this message's body until that receive's body is posted
        (:meth:`_isend_after`). A caller with several such receives calls
        ``progress()`` on every one before it waits for any (:meth:`alltoallv`): a
        held body waits for its receive's progress.
        """
        self._check_peer(dst, "destination")
        self.check_usable()
        buf = check_payload(buf)
        self._call_traffic = True
        self.stats.bytes_sent += buf.numel()
        self.stats.messages_sent += 1
        if after is None:
            return self._isend(buf, dst, tag)
        return self._isend_after(buf, dst, tag, after)

    def _isend_after(self, buf: torch.Tensor, dst: int, tag: int, recv: Handle) -> Handle:
        """:meth:`_isend` of one side of an exchange with ``dst``, whose message to
        this rank ``recv`` receives. Here the same as :meth:`_isend`;
        :class:`~sparcml.comm.TorchDistCommunicator` holds the body (gloo's
        rendezvous)."""
        return self._isend(buf, dst, tag)

    def irecv(self, src: int, tag: int = 0) -> Handle:
        """Non-blocking receive of one message of unknown length from ``src``.

        An abort note from ``src`` for the call in progress raises the origin's error
        (:mod:`sparcml.comm.abort`); a stale one is dropped and the receive posted again.
        """
        self._check_peer(src, "source")
        self.check_usable()
        self._call_traffic = True
        handle = self._irecv(src, tag)
        stats = self.stats

        def counted() -> torch.Tensor | None:
            h = handle
            while True:
                out = h.wait()
                assert out is not None
                if not isinstance(out, AbortNote):
                    break
                if out.stale(self._call, self._sequence):
                    h = self._irecv(src, tag)
                    continue
                raise out.error(self.rank)
            stats.bytes_recv += out.numel()
            stats.messages_recv += 1
            return out

        return Handle(counted, handle.progress, owner=handle)

    def send(self, buf: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(buf, dst, tag).wait()

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        out = self.irecv(src, tag).wait()
        assert out is not None
        return out

    def sendrecv(
        self, buf: torch.Tensor, peer: int, tag: int = 0, *, exchange: bool = True
    ) -> torch.Tensor:
        """Send ``buf`` to ``peer`` and receive its message.

        ``exchange``: ``peer`` sends to this rank at the same time, without waiting
        for anything from it (both halves of an exchange: the order of
        :attr:`receives_first`, a held body). ``False`` where ``peer``'s message
        may come only after this one has arrived (a fold, whose partner answers in
        the unfold; a leader's reply): this message then goes whole at once, as a
        held body would wait for a receive that waits for it.
        """
        if exchange:
            send, recv = self.exchange_step(buf, peer, peer, tag)
        else:
            send = self.isend(buf, peer, tag)
            recv = self.irecv(peer, tag)
        out = recv.wait()
        send.wait()
        assert out is not None
        return out

    def exchange_step(
        self, buf: torch.Tensor, dst: int, src: int, tag: int = 0
    ) -> tuple[Handle, Handle]:
        """(send of ``buf`` to ``dst``, receive from ``src``), in the order
        :attr:`receives_first` asks; with ``dst == src`` an exchange (``after=``)."""
        if not self.receives_first:
            send = self.isend(buf, dst, tag)
            return send, self.irecv(src, tag)
        recv = self.irecv(src, tag)
        return self.isend(buf, dst, tag, after=recv if src == dst else None), recv

    # ----------------------------------------------------------- irregular collectives
    def alltoallv(self, parts: Sequence[torch.Tensor], tag: int = 0) -> list[torch.Tensor]:
        """Personalised all-to-all: ``parts[j]`` goes to rank ``j``; any sizes, zero included.

        Destinations are rotated (rank ``r`` sends to ``r+1, r+2, ...`` first) so
        no rank is everybody's first target. ``parts[self.rank]`` is returned as is.

        Returns:
            ``received[j]``: what rank ``j`` sent here.
        """
        p, me = self.world_size, self.rank
        if len(parts) != p:
            raise ValueError(f"alltoallv needs {p} parts (one per rank), got {len(parts)}")
        # receives first only with one peer: with several, a send posted first to a
        # failed peer fails at once, which the failure agreement needs (receives
        # first, a survivor under load sometimes blamed another survivor that had
        # left: tests/test_failures.py::test_an_error_every_rank_raised_...)
        first = self.receives_first and p == 2
        recvs = {(me - s) % p: self.irecv((me - s) % p, tag) for s in range(1, p) if first}
        sends = [
            self.isend(parts[(me + s) % p], (me + s) % p, tag, after=recvs.get((me + s) % p))
            for s in range(1, p)
        ]
        if not first:
            recvs = {(me - s) % p: self.irecv((me - s) % p, tag) for s in range(1, p)}
        for h in recvs.values():  # every body's receive posted before any is waited for
            h.progress()
        out: list[torch.Tensor] = []
        for j in range(p):
            if j == me:
                out.append(check_payload(parts[me]))
            else:
                got = recvs[j].wait()
                assert got is not None
                out.append(got)
        for h in sends:
            h.wait()
        return out

    def allgatherv(self, buf: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Every rank's payload (any sizes, zero included), in rank order, on every rank.

        Ring algorithm: ``P-1`` steps, each rank forwards the block it received in
        the step before; every rank sends and receives the others' bytes once.
        """
        p, me = self.world_size, self.rank
        blocks: list[torch.Tensor | None] = [None] * p
        blocks[me] = check_payload(buf)
        right, left = (me + 1) % p, (me - 1) % p
        for s in range(p - 1):
            outgoing = blocks[(me - s) % p]
            assert outgoing is not None
            # (at P = 2 left is right: an exchange)
            h, recv = self.exchange_step(outgoing, right, left, tag)
            blocks[(me - s - 1) % p] = recv.wait()
            h.wait()
        return [b for b in blocks if b is not None]

    # ----------------------------------------------------------- dense collectives
    def allgather(self, tensor: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Dense allgather of equally shaped tensors; returns the list in rank order."""
        flat = dense_1d(tensor)
        got = self.allgatherv(as_bytes(flat), tag)
        out = []
        for i, g in enumerate(got):
            if g.numel() != flat.numel() * flat.element_size():
                raise ValueError(
                    f"allgather: rank {i} sent {g.numel()} bytes, rank {self.rank} "
                    f"expected {flat.numel() * flat.element_size()} (shapes differ across ranks)"
                )
            out.append(bytes_as(g.to(tensor.device), tensor.dtype).reshape(tensor.shape))
        return out

    def allreduce(
        self, tensor: torch.Tensor, op: str = "sum", tag: int = 0, *, donate: bool = False
    ) -> torch.Tensor:
        """Dense allreduce; returns the result, identical bits on every rank.

        Generic version: ring reduce-scatter then ring allgather (``2(P-1)/P``
        of the vector sent per rank). Each chunk is reduced once, in a fixed ring
        order, then copied, so every rank ends with the same bits.

        Args:
            op: ``"sum"``, ``"max"`` or ``"min"``.
            donate: the caller hands ``tensor`` over (a fresh tensor it will not
                read again): a backend may reduce into its storage instead of a
                copy (torch.distributed does; the result is then ``tensor``).
                Without it, ``tensor`` is never written.
        """
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"unknown reduction {op!r}; use sum, max or min")
        p, me = self.world_size, self.rank
        flat = tensor.detach().contiguous().reshape(-1).clone()
        if p == 1:
            return flat.reshape(tensor.shape)
        n = flat.numel()
        bounds = [i * n // p for i in range(p + 1)]
        chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(p)]
        right, left = (me + 1) % p, (me - 1) % p

        def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
            # (at P = 2 left is right: an exchange)
            h, recv = self.exchange_step(as_bytes(chunks[send_idx]), right, left, tag)
            got = recv.wait()
            assert got is not None
            h.wait()
            raw, idx = got.to(flat.device), recv_idx
            if raw.numel() != chunks[idx].numel() * flat.element_size():
                # (a reducer would broadcast a wrong-sized chunk without a word)
                raise RankMismatchError(
                    f"allreduce: rank {left} sent {raw.numel()} bytes for chunk {idx}, rank "
                    f"{me} expected {chunks[idx].numel() * flat.element_size()} ({n} "
                    f"{flat.dtype} values here): the ranks' tensors differ in size or dtype"
                )
            return bytes_as(raw, flat.dtype)

        # Reduce-scatter: after P-1 steps, rank r holds the full sum of chunk (r+1) % P.
        for s in range(p - 1):
            send_idx, recv_idx = (me - s) % p, (me - s - 1) % p
            chunks[recv_idx] = reducer(exchange(send_idx, recv_idx), chunks[recv_idx])
        # Allgather of the reduced chunks.
        for s in range(p - 1):
            send_idx, recv_idx = (me + 1 - s) % p, (me - s) % p
            chunks[recv_idx] = exchange(send_idx, recv_idx)
        return torch.cat(chunks).reshape(tensor.shape)

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier."""
        self.allreduce(torch.zeros(1, dtype=torch.int32))

    # ----------------------------------------------------------- background engine
    @property
    def engine(self) -> Any:
        """This communicator's background engine (created on first use)."""
        with self._engine_lock:
            if self._engine is None:
                from .engine import Engine

                self._engine = Engine(self)
            return self._engine

    @property
    def has_engine(self) -> bool:
        return self._engine is not None

    def run_ordered(self, fn: Callable[[], Any], async_op: bool = False) -> Any:
        """Run a collective ``fn`` keeping one order with the outstanding non-blocking ones.

        ``async_op`` returns a :class:`~sparcml.comm.engine.Work`. Blocking calls run
        inline while no engine exists, else queue behind the outstanding work.
        """
        if async_op or self.has_engine:
            return self.engine.run(fn, async_op)
        try:
            return fn()
        except BaseException as e:
            self.fail_call(e)
            raise

    def record_failure(self, exc: BaseException, call: int) -> None:
        """Tell the other ranks that this rank's own code raised ``exc`` in collective
        call ``call`` (an error the others may not see), so that they name this rank
        (not a neighbour) when they give up waiting in that call. Backends with a
        shared store implement it; the default does nothing."""
        return None

    def close(self) -> None:
        """Stop the background engine, if any."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": _sum,
    "max": torch.maximum,
    "min": torch.minimum,
}


class SelfCommunicator(Communicator):
    """A world of one rank: every collective is local, no process group needed."""

    def __init__(self, device: torch.device | str = "cpu", timeout: float = 300.0) -> None:
        super().__init__(0, 1, timeout)
        self.device = torch.device(device)

    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:  # pragma: no cover
        raise ValueError("a world of one rank has no peer to send to")

    def _irecv(self, src: int, tag: int) -> Handle:  # pragma: no cover
        raise ValueError("a world of one rank has no peer to receive from")
