"""A value quantizer alone (``qsgd``, ``natural``, ``dithering``, ``natural_dithering``).

Dense quantized allreduce: DSAR's split allgather with every message's values
quantized (paper 000 sec. 6; paper 004's C_nat / dithering as ``Q``, with the
aggregate re-compressed: the paper's bidirectional compression). Unbiased:
nothing is fed back.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ...collectives import sparse_allreduce
from ...compress.base import Quantizer
from ...stream import SparseStream
from .base import MethodConfig, MethodSpec, register_method

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = ["QUANTIZED", "QuantizedConfig"]


@dataclasses.dataclass
class QuantizedConfig(MethodConfig):
    """Attributes:
    compressor_params: the quantizer's hyperparameters (``{"bits": 4}``, ...).
    """

    compressor_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self, method: str) -> None:
        self.compressor_params = dict(self.compressor_params or {})


def run(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    op = state.operator(bucket.key)
    assert isinstance(op, Quantizer)
    # dense, whatever the gradient's zeros: a quantized value costs a byte or less,
    # its index would cost two to four more (and a sparse sum a merge)
    total = sparse_allreduce(
        SparseStream.dense(acc),
        state.comm,
        algorithm="dsar_split_allgather",
        quantizer=op,
        quantize="all",
        call_id=bucket.step,
    )
    return None, total.to_dense()


QUANTIZED = register_method(
    MethodSpec(
        "quantized",
        "a value quantizer alone in DSAR's quantized allreduce",
        run,
        config=QuantizedConfig,
        unbiased=True,
        operator=True,
        # quantize="all" makes the header exchange lossy: NaN/Inf on any rank is
        # refused on every rank before anything is quantized
        checks_nonfinite=True,
    )
)
