"""Sessions: what identifies a job at the aggregator (sparcml's addition to paper 004 App. A).

Paper 004 (appendix A) and SwitchML address a job's chunks by slot and trust
every packet. sparcml's version 1 addressed them by a job number that every run
reused (default 1), so a second run got the first one's shadow copies and a
restarted run mixed in the dead one's partial sums. A job is now a *session*:

* its workers agree on a random 64-bit token through their own process group
  (rank 0 draws it with :mod:`secrets`, :func:`agree_session` hands it to the
  others), so two runs, a run and its restart, or two jobs never share one;
* every packet carries the token; the aggregator creates the session on its
  first packet with the membership that packet declares (number of workers,
  mode) and from then on accepts only members of it;
* with an aggregator secret (``sparcml ina-server --secret-file``), rank 0 also
  derives the session's MAC key (:func:`~sparcml.ina.packet.session_key`, bound
  to token and membership) and hands it to the others with the token; every
  packet, both directions, is then tagged, and the aggregator derives the same
  key from its secret. The threat model of both modes is in docs/ina.md.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .packet import FIXED, NATURAL, session_key

if TYPE_CHECKING:
    from ..comm.base import Communicator

__all__ = ["InaSession", "agree_session", "mode_code"]

_WIRE = struct.Struct("!QB32s")  # token, keyed, key


def mode_code(mode: str) -> int:
    """The packet's mode of ``"natural"`` / ``"fixed"``."""
    if mode not in ("natural", "fixed"):
        raise ValueError(f"mode must be 'natural' or 'fixed', got {mode!r}")
    return NATURAL if mode == "natural" else FIXED


@dataclass(frozen=True)
class InaSession:
    """A session's token (random, non-zero, 64 bits) and, in keyed mode, its MAC key."""

    token: int
    key: bytes | None = None

    def __post_init__(self) -> None:
        if not 0 < self.token < 2**64:
            raise ValueError(f"a session token is a non-zero 64-bit integer, got {self.token}")
        if self.key is not None and len(self.key) != 32:
            raise ValueError(f"a session key has 32 bytes, got {len(self.key)}")

    def __repr__(self) -> str:  # never print the key
        return f"InaSession(token={self.token:#018x}, keyed={self.key is not None})"

    @classmethod
    def create(cls, workers: int, mode: str = "natural", secret: bytes | None = None) -> InaSession:
        """A new session for ``workers`` workers in ``mode``: a random token, and with the
        aggregator's ``secret`` the session's key."""
        token = secrets.randbits(64) or 1
        key = session_key(secret, token, workers, mode_code(mode)) if secret else None
        return cls(token, key)

    def to_bytes(self) -> bytes:
        return _WIRE.pack(self.token, self.key is not None, self.key or bytes(32))

    @classmethod
    def from_bytes(cls, data: bytes) -> InaSession:
        token, keyed, key = _WIRE.unpack(data)
        return cls(token, key if keyed else None)


def agree_session(
    comm: Communicator, mode: str = "natural", secret: bytes | None = None
) -> InaSession:
    """A collective: rank 0 creates the session (:meth:`InaSession.create`, with rank 0's
    ``secret``), every rank of ``comm`` returns it. Call it on every rank, in the same
    order as the other collectives."""
    mine = InaSession.create(comm.world_size, mode, secret) if comm.rank == 0 else None
    data = mine.to_bytes() if mine is not None else b""  # only rank 0's bytes travel
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
    )
    with comm.control():
        first = comm.allgatherv(buf)[0]
    return InaSession.from_bytes(bytes(first.to("cpu").numpy().tobytes()))
