"""Communicators: move byte payloads of unknown size between ranks (see :mod:`.base`)."""

from __future__ import annotations

import threading

import torch.distributed as dist

from .base import CommStats, Communicator, Handle, SelfCommunicator
from .local import LocalCommunicator, LocalWorld, run_ranks
from .mpi import MPICommunicator, mpi_available
from .torchdist import TorchDistCommunicator

__all__ = [
    "CommStats",
    "Communicator",
    "Handle",
    "LocalCommunicator",
    "LocalWorld",
    "MPICommunicator",
    "SelfCommunicator",
    "TorchDistCommunicator",
    "default_communicator",
    "mpi_available",
    "resolve",
    "run_ranks",
]

_default_lock = threading.Lock()
_default: dict[str, Communicator] = {}


def default_communicator() -> Communicator:
    """The communicator used when a collective gets ``comm=None``.

    The default torch.distributed process group when one is initialised (one
    cached communicator, so its stats and background engine persist), otherwise a
    world of one rank that needs no process group.
    """
    with _default_lock:
        if dist.is_available() and dist.is_initialized():
            comm = _default.get("dist")
            if not isinstance(comm, TorchDistCommunicator) or not comm.is_default_group():
                comm = TorchDistCommunicator()
                _default["dist"] = comm
            return comm
        comm = _default.get("self")
        if comm is None:
            comm = SelfCommunicator()
            _default["self"] = comm
        return comm


def resolve(comm: Communicator | None) -> Communicator:
    """``comm`` itself, or :func:`default_communicator` when it is None."""
    if comm is None:
        return default_communicator()
    if not isinstance(comm, Communicator):
        raise TypeError(f"expected a sparcml Communicator, got {type(comm).__name__}")
    return comm
