"""The dense baseline: the backend's allreduce of the dense vector.

Cost, whatever the sparsity, depends on the backend's algorithm: a ring (gloo,
NCCL, and the generic one of :class:`~sparcml.comm.Communicator` used by the
in-process and simulated ranks) costs ``2 (P-1) alpha + 2 (P-1)/P N beta_d``;
Rabenseifner's (MPI libraries, mostly) ``2 log2(P) alpha + 2 (P-1)/P N beta_d``
(paper 000, sec. 5.3.2, ``T_ar_rab``). The bandwidth term is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator, resolve
from ..stream import SparseStream
from .codec import EXACT, StreamCodec
from .registry import register

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["dense_allreduce"]


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """The ring: ``2(P-1) alpha + 2(P-1)/P N isize beta``, plus the ``(P-1)/P N`` additions."""
    return (
        2 * (p - 1) * model.alpha
        + 2 * (p - 1) / p * n * isize * model.beta
        + (p - 1) / p * n * model.gamma_add
    )


@register(
    "dense",
    auto=True,
    cost=cost,
    family=("sparcml", "topk"),
    auto_priority=3,
    dense_result=True,
    shares_nic=False,
)
def dense_allreduce(
    stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
) -> SparseStream:
    """Sum of every rank's ``stream`` by a dense allreduce; the result is a dense stream.

    Raises:
        ValueError: with a quantizer (the backend's allreduce sums full-precision
            words; use ``dsar_split_allgather`` to quantize the dense phase).
    """
    if codec.lossy:
        raise ValueError(
            "the dense algorithm cannot quantize; use algorithm='dsar_split_allgather' "
            "(SparCML sec. 6 quantizes its dense phase) or no quantizer"
        )
    comm = resolve(comm)
    # a sparse stream's dense vector is a fresh tensor: the backend reduces into it
    # (a dense stream's is the caller's storage, which is never written)
    return SparseStream.dense(comm.allreduce(stream.to_dense(), donate=not stream.is_dense))
