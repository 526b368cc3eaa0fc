"""Exceptions raised by sparcml.

Every error names the problem and, where a peer is involved, the rank: a user
who sees one of these in a 64-rank job must know which rank to look at.
"""

from __future__ import annotations

try:  # torch >= 2.2: catchable with the rest of torch.distributed's errors
    from torch.distributed import DistError as _DistError
except ImportError:  # pragma: no cover - older torch
    _DistError = RuntimeError  # type: ignore[assignment,misc]


class SparcmlError(Exception):
    """Base class of every error sparcml raises on purpose."""


class WireFormatError(SparcmlError, ValueError):
    """A byte buffer is not a valid sparcml message (truncated, corrupt, wrong version)."""


class RankMismatchError(SparcmlError, ValueError):
    """Ranks called the same collective with incompatible arguments (size, dtype, ...)."""


class CommError(SparcmlError, _DistError):
    """A communication step failed. ``peer`` is the rank involved, when known.

    Also a ``torch.distributed.DistError`` (hence a ``RuntimeError``), so code that
    catches torch.distributed's failures catches sparcml's too.

    ``peer`` names the root cause as far as this rank can tell: the first rank that
    failed (raised, died or stopped answering), which is not necessarily the rank
    this one was waiting for when it gave up (see README, "Errors").
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not send (or receive) within the communicator's timeout: it is
    stopped, hung, or not calling the same collective. ``peer`` is that rank."""


class PeerFailedError(CommError):
    """A peer died, closed its connection, or raised an error of its own (its
    message is quoted). ``peer`` is that rank."""


class RankAbortedError(CommError):
    """This rank stopped because another rank of the same in-process world failed."""


class NonFiniteError(SparcmlError, ValueError):
    """A quantizer got NaN/Inf values on some rank; raised on every rank alike,
    naming the ranks (quantizers cannot represent non-finite values)."""
