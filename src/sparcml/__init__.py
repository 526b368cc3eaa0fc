"""sparcml: sparse and compressed gradient collectives for data-parallel PyTorch training.

Quick start (a world of one rank needs no process group)::

    import torch, sparcml
    s = sparcml.SparseStream.from_dense(torch.tensor([0.0, 1.5, 0.0, -2.0]))
    total = sparcml.sparse_allreduce(s)          # sum over all ranks
    dense = total.to_dense()

Under ``torchrun`` after ``torch.distributed.init_process_group("gloo")`` the same
call reduces across every rank.
"""

from __future__ import annotations

from . import comm, compress
from . import torch as torch
from .collectives import (
    OkTopkState,
    algorithms,
    dsar_split_allgather,
    oktopk_allreduce,
    sparse_allgather,
    sparse_allreduce,
    ssar_recursive_double,
    ssar_split_allgather,
)
from .comm.engine import Work
from .costmodel import CostModel, expected_fill_in
from .errors import (
    CommError,
    CommTimeoutError,
    NonFiniteError,
    PeerFailedError,
    RankMismatchError,
    SparcmlError,
    WireFormatError,
)
from .sgd.feedback import ErrorFeedback
from .sgd.oktopk_sgd import oktopk_sgd_step
from .sgd.topk_sgd import topk_sgd_step
from .stream import SparseStream, dense_threshold, index_bytes

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommTimeoutError",
    "CostModel",
    "ErrorFeedback",
    "NonFiniteError",
    "OkTopkState",
    "PeerFailedError",
    "RankMismatchError",
    "SparcmlError",
    "SparseStream",
    "WireFormatError",
    "Work",
    "algorithms",
    "comm",
    "compress",
    "dense_threshold",
    "dsar_split_allgather",
    "expected_fill_in",
    "index_bytes",
    "oktopk_allreduce",
    "oktopk_sgd_step",
    "sparse_allgather",
    "sparse_allreduce",
    "ssar_recursive_double",
    "ssar_split_allgather",
    "topk_sgd_step",
]
