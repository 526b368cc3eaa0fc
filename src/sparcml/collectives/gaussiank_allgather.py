"""Gaussiank: Gaussian-fit threshold selection, then allgather (Shi et al., 2019; paper 001).

Steps:

1. Select about ``k`` entries of the accumulator with a threshold from a Gaussian
   fit of its values (:class:`~sparcml.compress.gaussiank.GaussianK`).
2. Allgather the selections and sum them locally, as :mod:`.topka` does.

Bandwidth ``2k(P-1) beta``, like TopkA; cheaper selection than exact top-k.
"""

from __future__ import annotations

from ..comm import Communicator, resolve
from ..compress.gaussiank import GaussianK
from ..stream import SparseStream
from .codec import EXACT, StreamCodec
from .registry import register
from .topka import cost as topka_cost
from .topka import topka

__all__ = ["gaussiank"]


@register(
    "gaussiank",
    exact=False,
    input="accumulator",
    cost=topka_cost,  # TopkA's exchange; the Gaussian fit is two reductions
    quadratic=True,
    family=("topk",),
    node_aware=True,  # TopkA's allgather, in two levels on nodes
)
def gaussiank(
    stream: SparseStream,
    comm: Communicator | None = None,
    codec: StreamCodec = EXACT,
    k: int | None = None,
) -> SparseStream:
    """Sum over ranks of each accumulator's Gaussian-threshold selection.

    Args:
        stream: this rank's accumulator (dense or sparse stream of the vector).
        comm: the communicator (default: the default process group, or a world of one).
        codec: how messages are encoded (exact by default).
        k: the target selection size per rank (required).

    Raises:
        ValueError: ``k`` missing.
    """
    if k is None:
        raise ValueError("algorithm 'gaussiank' needs k= (the selection size per rank)")
    selected = GaussianK(k=k).select(stream.to_dense())
    return topka(selected, resolve(comm), codec)
