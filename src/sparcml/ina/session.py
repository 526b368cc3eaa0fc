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
* with an aggregator secret (``sparcml ina-server --secret-file``, and
  ``secret`` on every rank), each rank derives the session's MAC key from
  the secret and the token (:func:`~sparcml.ina.packet.session_key`, bound to
  the membership too); every packet, both directions, is then tagged, and the
  aggregator derives the same key from its secret. The key never travels: the
  process group only carries the token and an 8-byte fingerprint of each rank's
  secret, so ranks given different secrets (or some none) all fail at once
  instead of waiting for results the aggregator will never send. The threat
  model of both modes is in docs/ina.md.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .packet import FIXED, NATURAL, session_key

if TYPE_CHECKING:
    from ..comm.base import Communicator

__all__ = ["InaSession", "agree_session", "mode_code"]

_FINGERPRINT = 8  # bytes of a secret's fingerprint in the agreement


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

    # (the class has no byte form on purpose: a key is derived where it is used)


def _fingerprint(secret: bytes | None) -> bytes:
    if secret is None:
        return bytes(_FINGERPRINT)
    return hashlib.blake2b(secret, digest_size=_FINGERPRINT, person=b"sparcml-ina-fp").digest()


def agree_session(
    comm: Communicator, mode: str = "natural", secret: bytes | None = None
) -> InaSession:
    """A collective: rank 0 draws the token, every rank of ``comm`` returns the session
    (keyed with ``secret``, which every rank must then hold: the key is derived on
    each rank, never sent). Call it on every rank, in the same order as the other
    collectives.

    Raises:
        ValueError: on every rank, when the ranks' secrets differ (or some have none).
    """
    code = mode_code(mode)
    mine = _fingerprint(secret)
    if comm.rank == 0:
        mine += struct.pack("!Q", secrets.randbits(64) or 1)
    buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    with comm.control():
        got = [bytes(b.to("cpu").numpy().tobytes()) for b in comm.allgatherv(buf)]
    prints = [g[:_FINGERPRINT] for g in got]
    if any(fp != prints[0] for fp in prints):
        keyed = [r for r, fp in enumerate(prints) if fp != bytes(_FINGERPRINT)]
        raise ValueError(
            f"natural_ina: secret differs across ranks (ranks with one: {keyed}; "
            f"ranks whose secret differs from rank 0's: "
            f"{[r for r, fp in enumerate(prints) if fp != prints[0]]}); give every rank "
            "the aggregator's secret, or none"
        )
    (token,) = struct.unpack("!Q", got[0][_FINGERPRINT:])
    key = session_key(secret, token, comm.world_size, code) if secret is not None else None
    return InaSession(token, key)
