"""Communicators: move byte payloads of unknown size between ranks (see :mod:`.base`)."""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

from .base import CommStats, Communicator, Handle, SelfCommunicator
from .hostmem import enable_huge_pages, keep_freed_memory
from .local import LocalCommunicator, LocalWorld, run_ranks
from .mpi import MPICommunicator, mpi_available
from .topology import SubCommunicator, Topology, TopologyError, detect_topology
from .torchdist import TorchDistCommunicator

__all__ = [
    "CommStats",
    "Communicator",
    "Handle",
    "LocalCommunicator",
    "LocalWorld",
    "MPICommunicator",
    "SelfCommunicator",
    "SubCommunicator",
    "Topology",
    "TopologyError",
    "TorchDistCommunicator",
    "default_communicator",
    "detect_topology",
    "enable_huge_pages",
    "keep_freed_memory",
    "mpi_available",
    "refuse_silent_world_of_one",
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

    Raises:
        RuntimeError: no process group, but a launcher (torchrun, mpirun) started
            several ranks: each would silently reduce alone.
    """
    with _default_lock:
        if dist.is_available() and dist.is_initialized():
            comm = _default.get("dist")
            if not isinstance(comm, TorchDistCommunicator) or not comm.is_default_group():
                comm = TorchDistCommunicator()
                _default["dist"] = comm
            return comm
        refuse_silent_world_of_one()
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


def refuse_silent_world_of_one() -> None:
    """Raise if a launcher started several ranks but nothing connects them.

    Training or reducing each rank alone would silently diverge, so say what is
    missing instead: the launcher's environment (``WORLD_SIZE``,
    ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``) says how many ranks there are.
    """
    for var, launcher, fix in (
        ("WORLD_SIZE", "torchrun", "call torch.distributed.init_process_group() first"),
        ("OMPI_COMM_WORLD_SIZE", "mpirun", "pass comm=sparcml.comm.MPICommunicator()"),
        ("PMI_SIZE", "mpirun", "pass comm=sparcml.comm.MPICommunicator()"),
    ):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"{launcher} started {value} ranks ({var}={value}) but no communicator "
                f"connects them: {fix} (or pass comm= explicitly)"
            )
