"""A value quantizer alone (``qsgd``, ``natural``, ``dithering``, ``natural_dithering``).

Dense quantized allreduce: DSAR's split allgather with every message's values
quantized (paper 000 sec. 6; paper 004's C_nat / dithering as ``Q``, with the
aggregate re-compressed: the paper's bidirectional compression). Unbiased:
nothing is fed back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...collectives import sparse_allreduce
from ...collectives.codec import StreamCodec
from ...compress.base import Quantizer, check_kind
from ...stream import SparseStream
from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method
from .sparse import scatter

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = ["QUANTIZED", "Quantized"]


@dataclasses.dataclass(frozen=True)
class Quantized(MethodConfig):
    """A value quantizer alone.

    Example:
        >>> Quantized("qsgd", compressor_params={"bits": 4}).name
        'qsgd'

    Attributes:
        quantizer: the quantizer (``natural``, ``qsgd``, ``dithering``,
            ``natural_dithering``).
        compressor_params: the quantizer's hyperparameters (``{"bits": 4}``, ...).
    """

    NAME_FIELDS: ClassVar[tuple[str, ...]] = ("quantizer",)

    quantizer: str = "natural"
    compressor_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.quantizer

    @classmethod
    def from_name(cls, name: str, options: Mapping[str, Any]) -> Quantized:
        return cls(quantizer=name, **options)

    def validate(self) -> None:
        check_kind(self.quantizer, "quantizer")
        object.__setattr__(self, "compressor_params", dict(self.compressor_params or {}))


def run(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    op = group.operator(bucket.key)
    assert isinstance(op, Quantizer)
    # dense, whatever the gradient's zeros: a quantized value costs a byte or less,
    # its index would cost two to four more (and a sparse sum a merge)
    total = sparse_allreduce(
        SparseStream.dense(acc),
        group.comm,
        algorithm="dsar_split_allgather",
        quantizer=op,
        quantize="all",
        call_id=bucket.step,
    )
    return MethodResult(None, total.to_dense())


def scatter_quantized(
    group: GroupView, bucket: Bucket, acc: torch.Tensor, bounds: list[int]
) -> MethodResult:
    """FSDP2's reduce-scatter: every rank quantizes each piece it sends once, the
    owner decodes the ``P`` pieces and sums them in rank order."""
    op = group.operator(bucket.key)
    assert isinstance(op, Quantizer)
    codec = StreamCodec(op, "contributions")
    return MethodResult(None, scatter(SparseStream.dense(acc), group.comm, codec, bounds))


QUANTIZED = register_method(
    MethodSpec(
        "quantized",
        "a value quantizer alone in DSAR's quantized allreduce",
        run,
        config=Quantized,
        unbiased=True,
        operator=True,
        scatter=scatter_quantized,
        # quantize="all" makes the header exchange lossy: NaN/Inf on any rank is
        # refused on every rank before anything is quantized
        checks_nonfinite=True,
    )
)
