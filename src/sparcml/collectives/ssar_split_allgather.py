"""SSAR_Split_allgather: split phase, then sparse allgather (paper 000, sec. 5.3.2).

Steps:

1. Split the index space into ``P`` ranges; send range ``j`` of the local
   stream to rank ``j`` (non-blocking, destinations rotated).
2. Rank ``j`` sums the pieces of its range, in rank order.
3. Concatenating sparse allgather (recursive doubling) of the reduced ranges;
   every rank concatenates them (disjoint summation, sec. 5.1).

Cost, with ``L2(P) = (P-1) alpha + log2(P) alpha``:

    L2(P) + 2 (P-1)/P k beta_s  <=  T_ssar_split_ag  <=  L2(P) + P k beta_s

Best for a moderate number of ranks while the result stays sparse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator, resolve
from ..costmodel import expected_fill_in
from ..stream import SparseStream
from ._common import allgather_cost, decode_ranges, split_and_reduce, split_cost
from .codec import EXACT, StreamCodec
from .registry import register
from .sparse_allgather import allgather_buffers

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["ssar_split_allgather"]


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """``T_split`` then the recursive-doubling allgather of the reduced ranges, each
    holding ``E[K]/P`` pairs (Appendix B), and the concatenation."""
    fill = expected_fill_in(n, ks)
    t = split_cost(model, p, n, ks, isize)
    t += allgather_cost(model, p, max(n // p, 1), fill / p, isize)
    return t + model.gamma * fill


@register(
    "ssar_split_allgather",
    auto=True,
    cost=cost,
    quadratic=True,
    auto_priority=1,
    header_in_first_round=True,
)
def ssar_split_allgather(
    stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
) -> SparseStream:
    """Sum of every rank's ``stream`` by split and sparse allgather; same bits on every rank.

    Args:
        stream: this rank's vector (same size and dtype on every rank).
        comm: the communicator (default: the default process group, or a world of one).
        codec: how messages are encoded (exact by default; see :mod:`.codec`).

    Returns:
        The sum, on ``stream``'s device.
    """
    comm = resolve(comm)
    if comm.world_size == 1:
        return stream.clone()
    # Steps 1-2: split and reduce.
    mine, bounds, _ = split_and_reduce(stream, comm, codec)
    # Step 3: sparse allgather of the reduced ranges, then concatenation.
    buf = codec.encode(mine, partial=True)
    bufs = allgather_buffers(buf, comm)
    # decoded straight into the result (exact codec: one pass per range; this
    # rank's own range as its receivers decode it, without decoding it again)
    own = (comm.rank, codec.roundtrip(mine, buf, partial=True))
    return decode_ranges(codec, bufs, bounds, stream, comm.rank, "the gathered ranges", own)
