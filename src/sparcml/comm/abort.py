"""One rank's error is every rank's error: abort notes on the collective's own links.

MPI's and NCCL's contract is that a collective completes or fails on every
member. When one rank's own code raises inside a sparcml call (a bad argument
on that rank alone, a decoding error, a mismatch only it can see, a torch error),
its peers are blocked in receives from it, or from ranks blocked on it; without
help they wait out their timeout and then blame a neighbour. So a rank that
fails a call sends every peer an **abort note** on the same links the call's
messages take (tag, order and transport unchanged: an abort note is received by
whatever receive the peer has posted for that sender):

* the note carries the call's number, the origin rank, and the origin's error
  type and message;
* a rank that receives a note for the call it is in (or a later one) raises at
  once: the origin's :class:`~sparcml.errors.RankMismatchError`,
  :class:`~sparcml.errors.NonFiniteError` or ``FloatingPointError`` as the same
  type and text (a configuration difference is reported alike everywhere), any
  other error as :class:`~sparcml.errors.PeerFailedError` naming the origin and
  quoting its error; it then sends its own notes (the origin's), so ranks blocked
  on *it* learn too: the failure spreads along the chain of waits, in message
  latencies, with no polling and nothing on the success path;
* a note of an earlier call (a peer that failed a call this rank completed, or
  notes every rank sent when all failed alike) is dropped and the receive posted
  again: a stale note never fails a later call;
* the failing rank's error leaves once its notes are sent or after
  :attr:`~sparcml.comm.Communicator.NOTE_FLUSH_S` (0.25 s), whichever is first;
  the sends go on in the background (a transport such as gloo completes a send
  only once the peer posts its receive, which a peer failing too never does).

Errors that every rank raises at the same point by construction (the checks of
the consistency headers once every rank holds every header, NaN/Inf checks
agreed by a collective) need no note: they are *uniform*
(:func:`is_uniform`). After a non-uniform failure the messages of the abandoned
call may still be in flight, so the communicator refuses further use on every
rank that failed it (NCCL's communicator abort): create a new one.

Not covered: a rank blocked inside a backend's own dense collective (gloo's or
MPI's allreduce) learns only at its timeout, which names the origin through the
failure record (:mod:`~sparcml.comm.faults`).

This goes beyond the papers, which assume correct, matching calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct

from ..errors import CommError, NonFiniteError, PeerFailedError, RankMismatchError

__all__ = ["ABORT_MAGIC", "AbortNote", "is_uniform", "mark_uniform"]

ABORT_MAGIC = b"SPCMLABT"
_HEAD = struct.Struct("<8sqi")  # magic, call number, origin rank
#: errors re-raised as their own type on the other ranks (same text)
_AGREED = {
    "RankMismatchError": RankMismatchError,
    "NonFiniteError": NonFiniteError,
    "FloatingPointError": FloatingPointError,
}
_MAX_MESSAGE = 2000


@dataclasses.dataclass(frozen=True)
class AbortNote:
    """Rank ``origin`` failed call ``call`` with ``error_type``: ``message``."""

    call: int
    origin: int
    error_type: str
    message: str

    @classmethod
    def of(cls, call: int, origin: int, exc: BaseException) -> AbortNote:
        """The note for ``exc``; a forwarded error keeps its origin and text."""
        note = getattr(exc, "_sparcml_note", None)
        if isinstance(note, AbortNote):
            return note
        return cls(call, origin, type(exc).__name__, str(exc)[:_MAX_MESSAGE])

    def encode(self) -> bytes:
        body = json.dumps([self.error_type, self.message]).encode()
        return _HEAD.pack(ABORT_MAGIC, self.call, self.origin) + body

    @classmethod
    def decode(cls, buf: bytes) -> AbortNote | None:
        """The note ``buf`` holds, or None when it is not one."""
        if len(buf) < _HEAD.size or buf[:8] != ABORT_MAGIC:
            return None
        _, call, origin = _HEAD.unpack_from(buf)
        try:
            error_type, message = json.loads(buf[_HEAD.size :].decode("utf-8", "replace"))
        except (ValueError, TypeError):
            error_type, message = "Exception", "(an unreadable abort note)"
        return cls(call, origin, str(error_type), str(message))

    def stale(self, in_call: int | None, sequence: int) -> bool:
        """Whether the note is of a call this rank is past: ``in_call`` is the call
        this rank is in (None between calls), ``sequence`` its last call's number."""
        if in_call is not None:
            return self.call < in_call
        return self.call <= sequence

    def error(self, me: int) -> Exception:
        """The error this rank raises for the note."""
        agreed = _AGREED.get(self.error_type)
        if agreed is not None:
            exc: Exception = agreed(f"{self.message} [found by rank {self.origin}]")
        else:
            exc = PeerFailedError(
                f"rank {me}: call {self.call} failed because rank {self.origin} raised "
                f"{self.error_type}: {self.message}",
                peer=self.origin,
            )
        exc._sparcml_note = self  # type: ignore[attr-defined]  # forwarded as is
        mark_uniform(exc, False)
        return exc


def mark_uniform(exc: BaseException, uniform: bool) -> BaseException:
    """Record whether every rank raises ``exc`` at the same point (see the module doc)."""
    with contextlib.suppress(AttributeError):  # exceptions without a __dict__
        exc._sparcml_uniform = uniform  # type: ignore[attr-defined]
    return exc


def is_uniform(exc: BaseException) -> bool:
    """True for an error every rank raises alike, which needs no abort note:
    communication errors (already resolved through the failure record), and
    mismatch and NaN/Inf errors unless marked otherwise (a mismatch that only some
    ranks could see is marked non-uniform where it is found)."""
    marked = getattr(exc, "_sparcml_uniform", None)
    if marked is not None:
        return bool(marked)
    return isinstance(exc, CommError | RankMismatchError | NonFiniteError | FloatingPointError)
