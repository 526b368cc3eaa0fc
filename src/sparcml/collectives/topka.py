"""TopkA: allgather of every rank's local top-k, summed locally (Ok-Topk's baseline, paper 001).

Steps:

1. Each rank contributes its selected (index, value) pairs (its local top-k).
2. Concatenating allgather (recursive doubling, :mod:`.sparse_allgather`).
3. Every rank sums the ``P`` streams in rank order.

Bandwidth ``2k(P-1) beta`` (``k`` pairs of two words from each of the other
ranks): it grows linearly with ``P``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator, resolve
from ..indexcode import index_field_nbytes
from ..stream import SparseStream
from ._common import fold_messages, log2_ceil
from .codec import EXACT, StreamCodec
from .registry import register

if TYPE_CHECKING:
    from ..costmodel import CostModel
from .sparse_allgather import gather_streams

__all__ = ["topka"]


def _allgather_cost(model: CostModel, p: int, pairs: float, pair: float) -> float:
    """Recursive-doubling allgather of ``pairs`` pairs from each of ``p`` ranks."""
    return (log2_ceil(p) + fold_messages(p)) * model.alpha + model.beta_pairs * (
        p - 1
    ) * pairs * pair


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """Recursive-doubling allgather of every rank's ``k`` pairs (paper 001's table:
    ``log P alpha + 2(P-1) k beta`` in words), then the merge of ``P k`` pairs. On
    ``M`` nodes of ``L`` ranks (``model.ranks_per_node``) the allgather runs in two
    levels (the ``node_aware`` fact): across nodes in ``L`` lanes sharing the NIC,
    ``M`` ranks each, then inside the node of ``L`` ranks holding ``M k`` pairs each."""
    k_mean = sum(ks) / len(ks) if ks else 0.0
    pair = index_field_nbytes(n, k_mean) / max(k_mean, 1) + isize  # as the wire codes them
    merge = model.gamma * p * k_mean
    lanes = model.ranks_per_node
    if lanes <= 1 or p % lanes or p == lanes:
        flat = model.inside() if p == lanes else model
        return _allgather_cost(flat, p, k_mean, pair) + merge
    nodes = p // lanes
    across = _allgather_cost(model.sharing_nic(lanes), nodes, k_mean, pair)
    return across + _allgather_cost(model.inside(), lanes, nodes * k_mean, pair) + merge


@register("topka", input="selection", cost=cost, quadratic=True, family=("topk",), node_aware=True)
def topka(
    stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
) -> SparseStream:
    """Sum of every rank's selected entries by allgather; same bits on every rank.

    Args:
        stream: this rank's selection (its local top-k), same size on every rank.
        comm: the communicator (default: the default process group, or a world of one).
        codec: how messages are encoded (exact by default).
    """
    comm = resolve(comm)
    if comm.world_size == 1:
        return stream.clone()
    return SparseStream.sum(gather_streams(stream, comm, codec))
