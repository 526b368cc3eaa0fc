"""Exceptions raised by sparcml.

Every error names the problem and, where a peer is involved, the rank: a user
who sees one of these in a 64-rank job must know which rank to look at.
"""

from __future__ import annotations


class SparcmlError(Exception):
    """Base class of every error sparcml raises on purpose."""


class WireFormatError(SparcmlError, ValueError):
    """A byte buffer is not a valid sparcml message (truncated, corrupt, wrong version)."""


class RankMismatchError(SparcmlError, ValueError):
    """Ranks called the same collective with incompatible arguments (size, dtype, ...)."""


class CommError(SparcmlError, RuntimeError):
    """A communication step failed. ``peer`` is the rank involved, when known."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not send (or receive) within the communicator's timeout."""


class PeerFailedError(CommError):
    """A peer died or closed its connection."""


class RankAbortedError(CommError):
    """This rank stopped because another rank of the same in-process world failed."""
