"""torch.distributed backend: gloo with CPU tensors, NCCL with CUDA tensors.

Messages of unknown size, on CPU backends (gloo), use an eager protocol: the
receiver posts a buffer of :func:`eager_bytes` of the group's size at once (1 MiB
up to P = 9, down to ``EAGER_BYTES``, 256 KiB, from P = 33); the first message
carries an int64 length and up to that less 8 payload bytes, and only a longer
payload's remainder follows in a second message, received straight into the
result. A small message is then one message and one wait instead of two
(a length, then the payload the receiver can only post once it knows the
length): on an oversubscribed host each wait costs a scheduling delay, and the
collectives' small headers and sparse pieces are mostly small. NCCL needs
matching sizes, so there the length always travels alone, then the payload
(skipped when empty). Messages between one pair of ranks are matched in order,
so a collective's steps never mix.

Timeouts: every wait is bounded by the communicator's ``timeout``. A peer that
does not answer raises :class:`~sparcml.errors.CommTimeoutError` naming it; a
peer whose connection closes (it died) raises
:class:`~sparcml.errors.PeerFailedError` naming it. The rank named is the root
cause, agreed through the process group's store (:mod:`.faults`), not the
neighbour that gave up first. After either, the process group is no longer
usable (gloo closes the pair): treat it as fatal.

Dense collectives call torch.distributed's own ``all_reduce``/``all_gather``;
their bytes are counted as a ring algorithm moves them per rank:
``2(P-1)/P * n`` for allreduce and ``(P-1) * n`` for allgather of ``n`` bytes.
On CPU backends an allgather of at most ``DIRECT_ALLGATHER_BYTES`` per rank is
one ``all_to_all_single`` of the piece repeated P times instead: every rank
sends its piece to every other rank directly, one round where gloo's ring
all_gather waits P - 1 times (the same bytes per rank). On an oversubscribed
host each wait is a scheduling delay, so a small piece goes faster direct; from
about ``DIRECT_ALLGATHER_BYTES`` the two are even and beyond it the ring's
pipelining wins, so larger pieces keep ``all_gather`` (measured by
``benchmarks/allgather_direct.py``; docs/benchmarks.md).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CommError, CommTimeoutError, PeerFailedError, WireFormatError
from ..reinterpret import as_bytes, bytes_as
from .abort import AbortNote
from .base import Communicator, Handle
from .faults import StoreFaults, agent_store, make_error, store_address, store_client

__all__ = ["DIRECT_ALLGATHER_BYTES", "EAGER_BYTES", "TorchDistCommunicator", "eager_bytes"]

EAGER_BYTES = 256 * 1024
"""The smallest first message of the eager protocol (length word included): a message
of up to this many bytes travels in one message, a longer one waits for the length to
arrive before its body's receive is posted (one round trip more: with 64 KiB the
all-to-all of 84 kB pieces, the split phase of ``ssar_split_allgather`` at P = 8,
N = 16M, d = 0.78%, took 12.6 ms where gloo's ``all_to_all_single`` took 7.4 ms;
with 256 KiB 6.9 ms against 4.9, ``benchmarks/alltoallv_eager.py``, docs/cluster.md)."""

EAGER_MAX = 1024 * 1024
"""The largest first message (:func:`eager_bytes`)."""

EAGER_BUDGET = 8 * 1024 * 1024
"""Bytes of first messages a rank posts at most for one message from every peer."""


def eager_bytes(world_size: int) -> int:
    """The first message's size in a group of ``world_size`` ranks (both ends of a
    pair agree: they are in the same group): ``EAGER_BUDGET / (P - 1)`` between
    ``EAGER_BYTES`` and ``EAGER_MAX``, a multiple of 4 KiB: 1 MiB up to P = 9, 256 KiB from P = 33.

    With a core per rank (P = 2, N = 16M, d = 0.781%, 1 Gbit/s) the split allgather's
    0.34 MB pieces and 0.65 MB ranges then go in one message each instead of a
    head and a body sent after a round trip: p50 15.6 -> 13.3 ms (12.4 -> 10.2 ms
    and 17.0 -> 14.9 ms in earlier jobs; ``benchmarks/eager_size.py``); at P = 4 and
    8 on two cores, where the ranks wait for the CPU, no difference. The budget
    bounds what a rank's receives hold at once in an all-to-all as P grows.
    """
    if world_size < 2:
        return EAGER_BYTES
    share = EAGER_BUDGET // (world_size - 1) // 4096 * 4096
    return max(EAGER_BYTES, min(EAGER_MAX, share))


#: seconds ``close`` and exit wait for the abort record's connection still being opened
_SETTLE_S = 2.0

DIRECT_ALLGATHER_BYTES = 256 * 1024
"""Largest piece per rank that CPU backends allgather directly (one all-to-all)."""

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _wrap_error(e: Exception, me: int, peer: int | None, what: str, timeout: float) -> CommError:
    text = str(e)
    who = f"rank {peer}" if peer is not None else "a peer"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CommTimeoutError(
            f"rank {me}: timed out after {timeout:g}s in {what} waiting for {who} "
            f"(is rank {peer} alive and calling the same collective?): {text}",
            peer=peer,
        )
    if "closed" in text.lower() or "reset" in text.lower() or "broken" in text.lower():
        return PeerFailedError(f"rank {me}: {who} failed during {what}: {text}", peer=peer)
    return CommError(f"rank {me}: {what} with {who} failed: {text}", peer=peer)


class TorchDistCommunicator(Communicator):
    """A communicator over a torch.distributed process group.

    Args:
        group: the process group (default: the default group). It must be
            initialised; for a world of one without a process group use
            :class:`~sparcml.comm.SelfCommunicator`.
        timeout: seconds to wait for a peer (default 300).
        device: where payloads travel: ``cpu`` for gloo (CUDA payloads are staged
            through host memory), the rank's CUDA device for NCCL. Inferred from
            the backend when omitted.

    Raises:
        RuntimeError: if torch.distributed is not initialised.
    """

    agrees_on_failures = True  # through the rendezvous store (comm/faults.py)

    def __init__(
        self,
        group: Any = None,
        timeout: float = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first, or pass no "
                "communicator for a world of one rank"
            )
        # The default group is looked up on every call rather than held: a reference
        # of ours would keep gloo's worker threads alive past destroy_process_group()
        # into interpreter finalization, where a thread freeing a finished work's
        # tensors needs the GIL and aborts the process (pthread_exit during forced
        # unwinding: "terminate called without an active exception").
        self._own_group = group if group is not None and group is not dist.group.WORLD else None
        self._world = weakref.ref(dist.group.WORLD) if self._own_group is None else None
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        super().__init__(rank, world, timeout)
        backend = str(dist.get_backend(self.group)).lower()
        self.backend = backend
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self._td = datetime.timedelta(seconds=self.timeout)
        # a receive may be posted larger than the message on CPU backends, not on NCCL
        self._eager = backend != "nccl" and self.device.type == "cpu"
        #: the eager protocol's first message, length word included (gloo)
        self.eager_bytes = eager_bytes(world)
        self.receives_first = self._eager  # (gloo's rendezvous; NCCL: send first)
        # bodies held for an exchange (_isend_after), by destination: an abort note
        # to that rank sends them first, so that the note meets the right receive
        self._held: dict[int, list[Callable[[], None]]] = {}
        self._faults: StoreFaults | None = None
        _live.add(self)
        if self.world_size > 1:
            self.faults.warm()  # the abort record's connection, before any failure

    @property
    def faults(self) -> StoreFaults:
        """The group's abort record (see :mod:`sparcml.comm.faults`)."""
        if self._faults is None:
            connect = None
            prefix = "sparcml"
            host: int | None = None
            address = None
            grace = min(max(2.0, 0.25 * self.timeout), 30.0)
            try:
                store = dist.distributed_c10d._get_default_store()
                connect = store_client(store, grace)
                address = store_address(store)
                prefix = f"sparcml/{dist.distributed_c10d._get_process_group_name(self.group)}"
                if not agent_store():
                    ranks = dist.get_process_group_ranks(self.group)
                    host = ranks.index(0) if 0 in ranks else None
            except Exception:  # no store: local evidence only
                connect = None
            self._faults = StoreFaults(
                connect, prefix, self.rank, self.world_size, grace, host,
                linger=self.timeout + 2 * grace, address=address,
                collective_wait=self.timeout,
            )  # fmt: skip
        return self._faults

    def record_failure(self, exc: BaseException, call: int) -> None:
        self.faults.record_local(exc, call)

    def _fail(self, e: Exception, peer: int | None, what: str) -> CommError:
        """The error to raise for ``e``, naming the root cause agreed through the store."""
        try:
            record = self.faults.resolve(e, peer, what, self.failing_call())
        except Exception:  # never hide the original failure behind our own
            return _wrap_error(e, self.rank, peer, what, self.timeout)
        return make_error(record, self.rank, peer, what, str(e).strip(), self.timeout)

    @property
    def group(self) -> Any:
        """The process group (the current default group when built on it)."""
        return self._own_group if self._own_group is not None else dist.group.WORLD

    def is_default_group(self) -> bool:
        """True when built on the default group that is still the current one."""
        return (
            self._own_group is None
            and self._world is not None
            and self._world() is dist.group.WORLD
        )

    def close(self) -> None:
        """Stop the background engine and drop the reference to a group of our own."""
        super().close()
        self._own_group = None
        if self._faults is not None:
            self._faults.settle(_SETTLE_S)

    @classmethod
    def dedicated(
        cls,
        ranks: list[int] | None = None,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> TorchDistCommunicator:
        """A communicator on a new process group of its own (a collective call).

        sparcml's background engine then never shares a group with the user's
        own collectives, which may run at the same time. Every rank of the
        default group must call this, in the same order.

        Args:
            ranks: global ranks of the new group (default: all).
            backend: ``gloo`` or ``nccl`` (default: the default group's backend).
            timeout: seconds to wait for a peer.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        group = dist.new_group(
            ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout)
        )
        if ranks is not None and dist.get_rank() not in ranks:
            raise ValueError(
                f"rank {dist.get_rank()} is not in {ranks}: only members get a communicator"
            )
        return cls(group=group, timeout=timeout)

    def _global(self, group_rank: int) -> int:
        if self._own_group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _wait(self, work: Any, peer: int | None, what: str) -> None:
        try:
            work.wait(self._td)
        except Exception as e:
            raise self._fail(e, peer, what) from e

    def _after_failure(self, origin: int) -> None:
        self.faults.acknowledge(origin, self.failing_call())

    def _send_note(self, payload: torch.Tensor, dst: int) -> Handle:
        # a body held for dst goes first: its receive is posted, or will be once its
        # head is in, and would take the note in its place (gloo matches in order)
        for post in list(self._held.get(dst, ())):
            with contextlib.suppress(Exception):
                post()
        # an abort note is a message whose length word is negative: -(bytes + 1)
        return self._isend(payload, dst, 0, note=True)

    def _isend(self, buf: torch.Tensor, dst: int, tag: int, note: bool = False) -> Handle:
        return self._send(buf, dst, tag, note, None)

    def _isend_after(self, buf: torch.Tensor, dst: int, tag: int, recv: Handle) -> Handle:
        """One side of an exchange with ``dst``: this message's body goes once ``recv``
        (this rank's receive of ``dst``'s message) has posted its own body.

        gloo sends an unbound buffer only after the receiver's ``recv ready`` note
        (a rendezvous), and writes both into one TCP connection in order: a body
        posted before this rank's note for the other direction goes into the socket
        ahead of that note, and the other body waits for all of it. Two 4 MB bodies
        crossing a 100 Mbit/s link took 601.66 ms (p50) where plain TCP took 362.73
        (``benchmarks/link_burst.py --transport sparcml``); held, 369.38 ms. The
        heads (length word and eager bytes) are never held, so both sides' bodies
        are posted as soon as the heads have crossed, when the peer sends without
        waiting for this message (an exchange). NCCL's path sends at once
        (:attr:`receives_first`).
        """
        return self._send(buf, dst, tag, False, recv if self._eager else None)

    def _send(
        self, buf: torch.Tensor, dst: int, tag: int, note: bool, after: Handle | None
    ) -> Handle:
        buf = buf.to(self.device)
        gdst = self._global(dst)
        self.stats.control_bytes += 8
        size = buf.numel()
        word = -(size + 1) if note else size
        if self._eager:
            inline = min(size, self.eager_bytes - 8)
            first = torch.empty(8 + inline, dtype=torch.uint8, device=self.device)
            first[:8].view(torch.int64).fill_(word)
            first[8:].copy_(buf[:inline])
            rest = buf[inline:] if size > inline else None
        else:
            first = torch.tensor([word], dtype=torch.int64, device=self.device)
            rest = buf if size else None
        try:
            works = [dist.isend(first, gdst, group=self.group, tag=tag)]
        except Exception as e:
            raise self._fail(e, dst, "send") from e
        held = [rest]  # the body, until it is posted

        def post_body() -> None:
            body, held[0] = held[0], None
            if body is None:
                return
            waiting = self._held.get(dst)
            if waiting is not None and post_body in waiting:
                waiting.remove(post_body)
            try:
                works.append(dist.isend(body, gdst, group=self.group, tag=tag))
            except Exception as e:
                raise self._fail(e, dst, "send") from e

        if after is None or rest is None:
            post_body()
        else:
            self._held.setdefault(dst, []).append(post_body)
            after.when_posted(post_body)

        def wait() -> None:
            post_body()  # (a receive that never posted its body: send it now)
            for w in works:
                self._wait(w, dst, "send")
            del works[:]
            _ = (first, rest)  # the closure keeps the tensors alive until the sends finish

        def sent() -> bool:
            # without waiting: an abort note's send may never complete (base._flush_notes)
            return held[0] is None and all(w.is_completed() for w in works)

        return Handle(wait, poll=sent)

    def _irecv(self, src: int, tag: int) -> Handle:
        eager = self._eager
        capacity = self.eager_bytes
        head = torch.empty(
            capacity if eager else 1,
            dtype=torch.uint8 if eager else torch.int64,
            device=self.device,
        )
        gsrc = self._global(src)
        self.stats.control_bytes += 8
        try:
            first = dist.irecv(head, gsrc, group=self.group, tag=tag)
        except Exception as e:
            raise self._fail(e, src, "recv") from e

        # the body's receive, once the length word has come (progress); then its end
        body: list[tuple[torch.Tensor, bool, dist.Work | None]] = []
        handle: list[Handle] = []  # (this receive's handle, for mark_posted)

        def progress() -> None:
            if body:
                return
            self._wait(first, src, "recv")
            size = int((head[:8].view(torch.int64) if eager else head).item())
            note = size < 0  # an abort note of -(size + 1) bytes (sparcml.comm.abort)
            if note:
                size = -size - 1
            inline = min(size, capacity - 8) if eager else 0
            if size == inline:
                # a small message gets its own bytes: a view would keep the whole
                # first message's receive buffer alive as long as the message is used
                small = size <= capacity // 4
                got = head[8 : 8 + size]
                body.append((got.clone() if small else got, note, None))
                handle[0].mark_posted()
                return
            try:
                out = torch.empty(size, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                raise  # (a real message this device has no room for)
            except (RuntimeError, MemoryError) as e:
                # a length word no sparcml message has (a message of the user's own on
                # this group and tag, say), named as the sender's, not a raw allocation
                # error of this rank's
                raise WireFormatError(
                    f"rank {self.rank}: rank {src} announced a message of {size:,} bytes, "
                    f"which cannot be allocated here ({str(e).splitlines()[0]}); is "
                    "another point-to-point message on this process group's tag?"
                ) from None
            out[:inline].copy_(head[8 : 8 + inline])
            try:
                work = dist.irecv(out[inline:], gsrc, group=self.group, tag=tag)
            except Exception as e:
                raise self._fail(e, src, "recv") from e
            body.append((out, note, work))
            handle[0].mark_posted()

        def wait() -> torch.Tensor | AbortNote:
            progress()
            out, note, work = body[0]
            if work is not None:
                self._wait(work, src, "recv")
            if not note:
                return out
            got = AbortNote.decode(bytes(out.cpu().numpy()))
            if got is None:
                raise CommError(f"rank {self.rank}: rank {src} sent an unreadable abort note")
            return got

        handle.append(Handle(wait, progress))
        handle[0].defer_until_posted()
        return handle[0]

    def allreduce(
        self, tensor: torch.Tensor, op: str = "sum", tag: int = 0, *, donate: bool = False
    ) -> torch.Tensor:
        """The backend's ``all_reduce``: of a copy, or with ``donate`` of ``tensor``
        itself when it is contiguous and on the group's device (no copy of it)."""
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}; use sum, max or min")
        t = tensor.detach()
        own = donate and t.device == self.device and t.is_contiguous()
        out = t if own else t.to(self.device, copy=True).contiguous()
        p = self.world_size
        if p > 1:
            self.check_usable()
            nbytes = out.numel() * out.element_size()
            self.stats.bytes_sent += 2 * (p - 1) * nbytes // p
            self.stats.bytes_recv += 2 * (p - 1) * nbytes // p
            try:
                work = dist.all_reduce(out, op=_OPS[op], group=self.group, async_op=True)
            except Exception as e:
                raise self._fail(e, None, "allreduce") from e
            self._wait(work, None, "allreduce")
        return out.to(tensor.device)

    def allgather(self, tensor: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        src = tensor.detach().to(self.device).contiguous()
        p = self.world_size
        if p > 1:
            self.check_usable()
        nbytes = src.numel() * src.element_size()
        if p > 1 and self._eager and 0 < nbytes <= DIRECT_ALLGATHER_BYTES:
            return [o.to(tensor.device) for o in self._allgather_direct(src)]
        outs = [torch.empty_like(src) for _ in range(p)]
        if p > 1:
            self.stats.bytes_sent += (p - 1) * nbytes
            self.stats.bytes_recv += (p - 1) * nbytes
            try:
                work = dist.all_gather(outs, src, group=self.group, async_op=True)
            except Exception as e:
                raise self._fail(e, None, "allgather") from e
            self._wait(work, None, "allgather")
        else:
            outs[0].copy_(src)
        return [o.to(tensor.device) for o in outs]

    def _allgather_direct(self, src: torch.Tensor) -> list[torch.Tensor]:
        """Allgather as one all-to-all of ``src`` repeated P times (see the module doc).

        The bytes travel as ``uint8`` (any dtype, gloo's all-to-all included) and the
        pieces come back as views into one received buffer.
        """
        p = self.world_size
        raw = as_bytes(src)
        nbytes = raw.numel()
        recv = torch.empty(p * nbytes, dtype=torch.uint8, device=self.device)
        self.stats.bytes_sent += (p - 1) * nbytes
        self.stats.bytes_recv += (p - 1) * nbytes
        try:
            work = dist.all_to_all_single(recv, raw.repeat(p), group=self.group, async_op=True)
        except Exception as e:
            raise self._fail(e, None, "allgather") from e
        self._wait(work, None, "allgather")
        return [
            bytes_as(recv[r * nbytes : (r + 1) * nbytes], src.dtype).view(src.shape)
            for r in range(p)
        ]

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1, dtype=torch.int32))


_live: weakref.WeakSet[TorchDistCommunicator] = weakref.WeakSet()


@atexit.register
def _release_groups() -> None:
    """At exit: stop the engines, then let our own process groups go.

    Run while the interpreter is still whole, so a group's worker threads are
    joined here instead of during finalization (see ``__init__``).
    """
    for comm in list(_live):
        with contextlib.suppress(Exception):  # exit must go on
            if comm._engine is not None:
                # bounded: an operation stuck on a dead peer must not hang exit
                comm._engine.shutdown(timeout=10.0)
                comm._engine = None
            comm._own_group = None
            if comm._faults is not None:
                comm._faults.settle(_SETTLE_S)
