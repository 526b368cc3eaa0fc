"""``dense``: the backend's allreduce of the bucket (what DDP does without a hook)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import MethodSpec, register_method

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = ["DENSE"]


def run(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    return acc, state.comm.allreduce(acc)


DENSE = register_method(
    MethodSpec(
        "dense",
        "dense allreduce (the baseline; what DDP does without a hook)",
        run,
        names=("dense",),
        unbiased=True,
        lossless=True,
    )
)
