"""sparcml: sparse and compressed gradient collectives for data-parallel PyTorch training.

Quick start (a world of one rank needs no process group)::

    import torch, sparcml
    s = sparcml.SparseStream.from_dense(torch.tensor([0.0, 1.5, 0.0, -2.0]))
    total = sparcml.sparse_allreduce(s)          # sum over all ranks
    dense = total.to_dense()

Under ``torchrun`` after ``torch.distributed.init_process_group("gloo")`` the same
call reduces across every rank.

Training (DDP hook, ``sync_gradients``, FSDP2): ``import sparcml.torch``
(:mod:`sparcml.torch`, not imported by this package). Everything else is reachable
through its module: errors in :mod:`sparcml.errors`, each algorithm in
:mod:`sparcml.collectives`, communicators in :mod:`sparcml.comm`, selectors and
quantizers in :mod:`sparcml.compress`.
"""

from __future__ import annotations

from . import comm, compress, errors
from .collectives import (
    OkTopkState,
    algorithms,
    oktopk_allreduce,
    sparse_allgather,
    sparse_allreduce,
)
from .comm.engine import Work
from .costmodel import CostModel
from .errors import SparcmlError
from .sgd.feedback import ErrorFeedback
from .stream import SparseStream

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "ErrorFeedback",
    "OkTopkState",
    "SparcmlError",
    "SparseStream",
    "Work",
    "algorithms",
    "comm",
    "compress",
    "errors",
    "oktopk_allreduce",
    "sparse_allgather",
    "sparse_allreduce",
]
