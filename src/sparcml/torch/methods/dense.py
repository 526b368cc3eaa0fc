"""``dense``: the backend's allreduce of the bucket (what DDP does without a hook)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from ...collectives.codec import EXACT
from ...stream import SparseStream
from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method
from .sparse import scatter

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = ["DENSE", "Dense"]


@dataclasses.dataclass(frozen=True)
class Dense(MethodConfig):
    """The backend's dense allreduce (no options)."""


def run(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    return MethodResult(acc, group.comm.allreduce(acc))


def scatter_dense(
    group: GroupView, bucket: Bucket, acc: torch.Tensor, bounds: list[int]
) -> MethodResult:
    """FSDP2's reference reduce-scatter: the dense chunks through the split, summed
    in rank order."""
    t0 = time.perf_counter()
    stream = SparseStream.dense(acc)  # (its local part: the stream over the chunks)
    local_s = time.perf_counter() - t0
    return MethodResult(acc, scatter(stream, group.comm, EXACT, bounds), local_s)


DENSE = register_method(
    MethodSpec(
        "dense",
        "dense allreduce (the baseline; what DDP does without a hook)",
        run,
        config=Dense,
        names=("dense",),
        unbiased=True,
        lossless=True,
        reference=True,
        sparse_gradients=True,
        scatter=scatter_dense,
    )
)
