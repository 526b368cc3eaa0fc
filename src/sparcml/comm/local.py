"""In-process ranks: one thread per rank, messages through shared mailboxes.

Used by the exhaustive property tests: :func:`run_ranks` runs an SPMD function
on ``world_size`` ranks in this process and returns their results in rank order.
If any rank raises, the others are aborted (they stop at their next
communication instead of waiting for a message that will never come) and the
first exception is re-raised in the caller, annotated with its rank.

A rank that times out names the rank that failed first, not merely the one it
was waiting for, by the same agreement as the torch.distributed backend
(:mod:`sparcml.comm.faults`) through an in-memory store the ranks share: it
publishes whom it waits for and follows the chain of waits to the rank that
reports nothing; a rank aborted meanwhile names the recorded rank too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import CommError, CommTimeoutError, RankAbortedError
from .abort import AbortNote
from .base import Communicator, Handle
from .faults import StoreFaults, make_error

__all__ = ["LocalCommunicator", "LocalWorld", "run_ranks"]

T = TypeVar("T")

_POLL_S = 0.02


class MemoryStore:
    """The part of ``torch.distributed.Store`` that :class:`~sparcml.comm.faults.StoreFaults`
    uses, in memory, for in-process ranks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``desired`` if the value is ``expected`` (absent counts as ``""``); return
        the value held afterwards."""
        with self._lock:
            cur = self._data.get(key)
            if (cur is None and expected == "") or cur == expected.encode():
                self._data[key] = desired.encode()
            return self._data.get(key, expected.encode())


class LocalWorld:
    """Mailboxes shared by the in-process ranks of one world."""

    def __init__(self, world_size: int, take_turns: bool = False) -> None:
        self.world_size = world_size
        self.aborted = threading.Event()
        # With take_turns, a rank computes only while it holds this lock and lets go
        # of it while it waits for a message (see run_ranks).
        self.turn: threading.Lock | None = threading.Lock() if take_turns else None
        self.turn_threads: set[int] = set()  # the rank threads that take turns
        self.store = MemoryStore()
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue[torch.Tensor]] = defaultdict(
            queue.SimpleQueue
        )

    def my_turn(self) -> threading.Lock | None:
        """The turn lock if the calling thread holds it (a rank's own thread, not a
        background engine), else None."""
        return self.turn if threading.get_ident() in self.turn_threads else None

    def box(self, src: int, dst: int, tag: int) -> queue.SimpleQueue[torch.Tensor]:
        with self._lock:
            return self._boxes[(src, dst, tag)]


def wait_for_message(
    box: queue.SimpleQueue[Any],
    aborted: threading.Event,
    rank: int,
    src: int,
    tag: int,
    timeout: float,
    poll_s: float = _POLL_S,
    turn: threading.Lock | None = None,
) -> Any:
    """Block on ``box`` until a message arrives, another rank fails, or ``timeout`` passes.

    ``turn``: the world's turn lock (``run_ranks(take_turns=True)``), held by the
    caller; let go while waiting and taken back before returning.

    Raises:
        RankAbortedError: another rank of the world failed.
        CommTimeoutError: nothing came from ``src`` within ``timeout`` seconds.
    """
    if turn is not None:
        turn.release()
        try:
            return wait_for_message(box, aborted, rank, src, tag, timeout, poll_s)
        finally:
            turn.acquire()
    deadline = time.monotonic() + timeout
    while True:
        if aborted.is_set():
            raise RankAbortedError(
                f"rank {rank}: aborted while waiting for rank {src} because another rank failed",
                peer=src,
            )
        try:
            return box.get(timeout=poll_s)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"rank {rank}: timed out after {timeout:g}s waiting "
                    f"for a message from rank {src} (tag {tag})",
                    peer=src,
                ) from None


class LocalCommunicator(Communicator):
    """One rank of a :class:`LocalWorld`. Payloads are copied on send (no aliasing)."""

    agrees_on_failures = True
    one_process = True

    def __init__(self, world: LocalWorld, rank: int, timeout: float = 30.0) -> None:
        super().__init__(rank, world.world_size, timeout)
        self.world = world
        self.device = torch.device("cpu")
        store = world.store
        grace = min(max(0.2, 0.5 * self.timeout), 5.0)
        self.faults = StoreFaults(lambda: store, "local", rank, world.world_size, grace, None)

    def _fail(self, e: CommError, peer: int) -> CommError:
        """The error naming the root cause (see the module docstring)."""
        call = self.failing_call()
        if isinstance(e, RankAbortedError):
            record = self.faults.read(call)
            if record is None:
                return e
        else:
            record = self.faults.resolve(e, peer, "recv", call)
        return make_error(record, self.rank, peer, "recv", str(e), self.timeout)

    def record_failure(self, exc: BaseException, call: int) -> None:
        self.faults.record_local(exc, call)

    def _send_note(self, payload: torch.Tensor, dst: int) -> Handle:
        note = AbortNote.decode(bytes(payload.numpy()))
        self.world.box(self.rank, dst, 0).put(note)
        return Handle.done()

    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:
        if self.world.aborted.is_set():
            raise RankAbortedError(f"rank {self.rank}: aborted because another rank failed")
        self.world.box(self.rank, dst, tag).put(buf.to("cpu", copy=True))
        return Handle.done()

    def _irecv(self, src: int, tag: int) -> Handle:
        box = self.world.box(src, self.rank, tag)

        def wait() -> torch.Tensor:
            turn = self.world.my_turn()
            try:
                got: torch.Tensor = wait_for_message(
                    box, self.world.aborted, self.rank, src, tag, self.timeout, turn=turn
                )
            except (CommTimeoutError, RankAbortedError) as e:
                raise self._fail(e, src) from e
            return got

        return Handle(wait)


def run_ranks(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 30.0,
    take_turns: bool = False,
) -> list[T]:
    """Run ``fn(comm, *args)`` on ``world_size`` in-process ranks; results in rank order.

    Args:
        world_size: number of ranks (threads), at least 1.
        fn: the SPMD function; its first argument is the rank's communicator.
        timeout: seconds a rank waits for a peer before raising
            :class:`~sparcml.errors.CommTimeoutError`.
        take_turns: at most one rank computes at a time; a rank hands the CPU on
            only while it waits for a message. A rank's thread CPU time then
            measures its own work as if it had a core to itself (no cache, GIL
            or scheduler contention from the other ranks): what ``sparcml
            bench-local`` reports as "alone". Results are the same either way.

    Raises:
        The first exception raised by any rank (with a note naming the rank);
        the other ranks are aborted instead of hanging.

    Example:
        >>> run_ranks(3, lambda comm: comm.rank * 10)
        [0, 10, 20]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world = LocalWorld(world_size, take_turns)
    comms = [LocalCommunicator(world, r, timeout) for r in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def body(r: int) -> None:
        if world.turn is not None:
            world.turn.acquire()
            world.turn_threads.add(threading.get_ident())
        try:
            results[r] = fn(comms[r], *args)
        except BaseException as e:
            with lock:
                errors.append((time.monotonic(), r, e))
            world.aborted.set()
        finally:
            comms[r].close()
            if world.turn is not None:
                world.turn.release()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"sparcml-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # The root cause is the earliest error that is not a consequence of the abort.
        primary = [e for e in errors if not isinstance(e[2], RankAbortedError)] or errors
        _, rank, exc = min(primary, key=lambda e: e[0])
        exc.add_note(f"(raised on in-process rank {rank} of {world_size})")
        raise exc
    return results
