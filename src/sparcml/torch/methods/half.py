"""``fp16`` and ``bf16``: the bucket cast to 16 bits, allreduced, cast back.

What PyTorch's ``fp16_compress_hook`` and ``bf16_compress_hook`` do, step for
step, so the baselines users compare with run under the same ``register(...,
method=...)`` call (and in layer rules: dense layers in 16 bits, the rest
top-k):

1. cast the bucket to the 16-bit type and divide it by ``P`` there (dividing
   first keeps the 16-bit sum in range);
2. allreduce (sum) the 16-bit values with the backend's allreduce;
3. cast the average back to the gradient's dtype.

Half the bytes of the fp32 allreduce; lossy (values are rounded to 16 bits,
float16 also loses range: beyond 65504 is Inf), unbiased in the sense of the
pipeline (every entry is sent, no error feedback). Not in the papers: the
baselines they are compared with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = ["BF16", "FP16", "Bf16", "Fp16"]


@dataclasses.dataclass(frozen=True)
class Fp16(MethodConfig):
    """float16 allreduce of the bucket divided by P (no options)."""


@dataclasses.dataclass(frozen=True)
class Bf16(MethodConfig):
    """bfloat16 allreduce of the bucket divided by P (no options)."""


def _spec(name: str, dtype: torch.dtype, hook: str, config: type[MethodConfig]) -> MethodSpec:
    def run(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
        # Steps 1-3 (the pipeline casts the average back to the gradient's dtype)
        # (a new tensor: acc may be the momentum buffer itself, kept after the call)
        low = acc.to(dtype, copy=True).div_(group.comm.world_size)
        return MethodResult(None, group.comm.allreduce(low))

    return register_method(
        MethodSpec(
            name,
            f"{str(dtype).removeprefix('torch.')} allreduce of the bucket divided by P "
            f"(PyTorch's {hook})",
            run,
            config=config,
            names=(name,),
            unbiased=True,
            carries_nonfinite=True,
            averages=True,
        )
    )


FP16 = _spec("fp16", torch.float16, "fp16_compress_hook", Fp16)
BF16 = _spec("bf16", torch.bfloat16, "bf16_compress_hook", Bf16)
