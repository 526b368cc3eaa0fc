"""Two-level shard-parallel sparse allreduce: inside the node, between nodes, inside again.

The composition of SparCML's production run (paper 000, sec. 8: a reduction
inside each node, the sparse allreduce between nodes), arranged as NCCL's and
Horovod's hierarchical allreduce arrange the dense one, so that every rank of a
node drives the NIC at once (one lane per local rank). The arrangement is this
library's; the paper describes the two levels, not the sharding.

With ``L`` ranks per node and ``n`` nodes (:class:`~sparcml.comm.topology.Topology`):

1. Reduce-scatter inside the node: split the index space into ``L`` shards and
   send shard ``l`` to the node's local rank ``l`` (the split phase of sec.
   5.3.2 on the node's ranks; a piece past ``delta`` travels dense, so this is
   a dense reduce-scatter at high density).
2. Between nodes: local rank ``l`` runs a flat sparse allreduce (``inner``,
   default recursive doubling, sec. 5.3.1) of its shard with local rank ``l``
   of every other node. All ``L`` lanes run at once, each with ``1/L`` of the
   index space.
3. Allgather inside the node: the node's ranks gather the ``L`` reduced shards
   (exact encoding: every rank holds the same final bits) and concatenate them
   (disjoint summation, sec. 5.1).

Cost, with inside-node pair ``(alpha_i, beta_i)``, between-node pair
``(alpha, beta)`` shared by ``L`` lanes (``beta L`` each), node fill-in
``K_node`` and total fill-in ``K``:

    T = T_split(L; k, alpha_i, beta_i) + T_inner(n; K_node/L, alpha, L beta)
        + T_allgather(L; K/L, alpha_i, beta_i) + gamma K

Every rank ends with the same bits: step 2's result is identical on every rank
of a lane (the inner algorithm's guarantee), step 3 hands it on exactly.
Inside the node, exact messages carry the fixed index fields under
``index_coding="auto"`` (:meth:`~.codec.StreamCodec.inside_node`: bytes are cheap
there, Elias--Fano's CPU is not); between nodes, the call's coding.
Quantizers: step 1 quantizes each rank's own contribution as the codec says;
under ``quantize="contributions"`` the partial sums of steps 2-3 travel exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator, resolve
from ..costmodel import expected_fill_in
from ..stream import SparseStream
from ._common import allgather_cost, decode_ranges, split_and_reduce, split_cost
from ._twolevel import (
    DEFAULT_INNER,
    check_inner,
    inner_codec,
    inner_cost,
    node_and_lane,
    node_ks,
    node_shape,
    register_inner_variants,
)
from .codec import EXACT, StreamCodec
from .registry import get_algorithm, register
from .sparse_allgather import allgather_buffers

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["twolevel_shard"]


def cost(
    model: CostModel, p: int, n: int, ks: Sequence[int], isize: int, inner: str = DEFAULT_INNER
) -> float:
    """Steps 1-3 above on contiguous nodes of ``model.ranks_per_node`` ranks, ``inner``
    between nodes."""
    nodes, per = node_shape(model, p)
    # the node's messages with the fixed index fields (as sent without a quantizer;
    # the Elias-Fano coding work they save is local work the model does not count)
    inside = model.inside(elias_fano=False)
    width = max(n // per, 1)
    t = split_cost(inside, per, n, ks, isize) if per > 1 else 0.0
    shard_ks = [min(k / per, width) for k in node_ks(ks, n, per)]  # (a shard holds <= width)
    t += inner_cost(model.sharing_nic(per), nodes, width, shard_ks, isize, inner)
    fill = expected_fill_in(n, ks)
    if per > 1:
        t += allgather_cost(inside, per, width, fill / per, isize)
    return t + model.gamma * fill


@register("twolevel_shard", auto=True, cost=cost, auto_priority=2, two_level=True)
def twolevel_shard(
    stream: SparseStream,
    comm: Communicator | None = None,
    codec: StreamCodec = EXACT,
    inner: str = DEFAULT_INNER,
) -> SparseStream:
    """Sum of every rank's ``stream`` in two levels, shard-parallel; same bits on every rank.

    Args:
        stream: this rank's vector (same size and dtype on every rank).
        comm: the communicator (default: the default process group, or a world of
            one); its :attr:`~sparcml.comm.Communicator.topology` says which ranks
            share a node.
        codec: how messages are encoded (exact by default; see :mod:`.codec`).
        inner: the flat algorithm between nodes (step 2).

    Returns:
        The sum, on ``stream``'s device.
    """
    comm = resolve(comm)
    check_inner(inner)
    if comm.world_size == 1:
        return stream.clone()
    node, lane = node_and_lane(comm)
    inside = codec.inside_node()  # fixed index fields inside the node (exact, "auto")
    # Step 1: reduce-scatter inside the node.
    if node.world_size > 1:
        mine, bounds, _ = split_and_reduce(stream, node, inside)
    else:
        mine, bounds = stream, [0, stream.size]
    # Step 2: the shard's sparse allreduce between nodes, one lane per local rank.
    if lane.world_size > 1:
        mine = get_algorithm(inner)(mine, lane, inner_codec(codec, own=node.world_size == 1))
    if node.world_size == 1:
        return mine
    # Step 3: allgather of the reduced shards inside the node, then concatenation.
    bufs = allgather_buffers(inside.encode_exact(mine), node)
    return decode_ranges(
        inside, bufs, bounds, stream, comm.rank, "the node's gathered shards", (node.rank, mine)
    )


# twolevel_shard+ssar_split_allgather, twolevel_shard+dsar_split_allgather: auto's other inners
register_inner_variants("twolevel_shard", cost)
