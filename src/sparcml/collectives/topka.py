"""TopkA: allgather of every rank's local top-k, summed locally (Ok-Topk's baseline, paper 001).

Steps:

1. Each rank contributes its selected (index, value) pairs (its local top-k).
2. Concatenating allgather (recursive doubling, :mod:`.sparse_allgather`).
3. Every rank sums the ``P`` streams in rank order.

Bandwidth ``2k(P-1) beta`` (``k`` pairs of two words from each of the other
ranks): it grows linearly with ``P``.
"""

from __future__ import annotations

from ..comm import Communicator, resolve
from ..stream import SparseStream
from .codec import EXACT, StreamCodec
from .registry import register
from .sparse_allgather import gather_streams

__all__ = ["topka"]


@register("topka")
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
