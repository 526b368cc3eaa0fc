"""Two-level leader-based sparse allreduce: to one rank per node, between leaders, back.

The plain composition of SparCML's production run (paper 000, sec. 8): each
node reduces to one rank, the nodes' leaders run the sparse allreduce, and each
leader hands the result to its node. Kept for comparison with the
shard-parallel arrangement (``twolevel_shard``), which keeps every rank of a
node busy; here one rank per node does the inter-node work.

With ``L`` ranks per node and ``n`` nodes:

1. Reduce to the leader (the node's lowest rank): every other rank of the node
   sends its stream to the leader, which sums the ``L`` contributions in local
   rank order (deterministic).
2. The leaders run a flat sparse allreduce (``inner``, default recursive
   doubling, sec. 5.3.1) of their node sums; the NIC carries one rank's traffic.
3. Broadcast inside the node: the leader sends the result, exactly encoded, to
   every other rank of its node.

Cost, with inside-node pair ``(alpha_i, beta_i)``, node fill-in ``K_node``, total
fill-in ``K``:

    T = (L-1) (alpha_i + k beta_i) + gamma L k + T_inner(n; K_node, alpha, beta)
        + (L-1) (alpha_i + K beta_i)

Inside the node, exact messages carry the fixed index fields under
``index_coding="auto"`` (:meth:`~.codec.StreamCodec.inside_node`); between the
leaders, the call's coding.

Every rank ends with the same bits: the leaders' results are identical (the
inner algorithm's guarantee) and step 3 hands them on exactly. Quantizers: the
ranks' own contributions are quantized as the codec says in step 1; under
``quantize="contributions"`` the leaders' partial sums travel exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator, resolve
from ..costmodel import expected_fill_in
from ..stream import SparseStream
from ._common import decode_or_empty, encode_or_empty
from ._twolevel import (
    DEFAULT_INNER,
    check_inner,
    inner_codec,
    inner_cost,
    node_ks,
    node_shape,
    register_inner_variants,
)
from .codec import EXACT, StreamCodec
from .registry import get_algorithm, register

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["twolevel_leader"]


def cost(
    model: CostModel, p: int, n: int, ks: Sequence[int], isize: int, inner: str = DEFAULT_INNER
) -> float:
    """Steps 1-3 above on contiguous nodes of ``model.ranks_per_node`` ranks, ``inner``
    between nodes."""
    nodes, per = node_shape(model, p)
    # the node's messages with the fixed index fields (as sent without a quantizer;
    # the Elias-Fano coding work they save is local work the model does not count)
    inside = model.inside(elias_fano=False)
    k = max(ks) if ks else 0
    fill = expected_fill_in(n, ks)
    t = (per - 1) * inside.message_time(k, n, isize) + model.gamma * per * k
    t += inner_cost(model.for_topology(1), nodes, n, node_ks(ks, n, per), isize, inner)
    return t + (per - 1) * inside.message_time(fill, n, isize)


@register("twolevel_leader", auto=True, cost=cost, auto_priority=4, two_level=True)
def twolevel_leader(
    stream: SparseStream,
    comm: Communicator | None = None,
    codec: StreamCodec = EXACT,
    inner: str = DEFAULT_INNER,
) -> SparseStream:
    """Sum of every rank's ``stream`` through one leader per node; same bits on every rank.

    Args:
        stream: this rank's vector (same size and dtype on every rank).
        comm: the communicator (default: the default process group, or a world of
            one); its :attr:`~sparcml.comm.Communicator.topology` says which ranks
            share a node.
        codec: how messages are encoded (exact by default; see :mod:`.codec`).
        inner: the flat algorithm among the leaders (step 2).

    Returns:
        The sum, on ``stream``'s device.
    """
    comm = resolve(comm)
    check_inner(inner)
    if comm.world_size == 1:
        return stream.clone()
    topo = comm.topology
    if topo.ranks_per_node == 1:  # every rank leads its node: the inner algorithm alone
        return get_algorithm(inner)(stream, comm.subgroup(topo.leaders()), codec)
    node = comm.subgroup(topo.node_ranks(comm.rank))
    size, dtype, device = stream.size, stream.dtype, stream.device
    inside = codec.inside_node()  # fixed index fields inside the node (exact, "auto")
    if node.rank != 0:
        # Step 1: the contribution to the leader; step 3: the result from it.
        # (sendrecv: the leader's abort note is seen while the send waits for it)
        got = node.sendrecv(encode_or_empty(stream, inside), 0, exchange=False)  # (a reply)
        return decode_or_empty(got, size, dtype, device)
    # Step 1 (leader): the node's sum, in local rank order.
    got = [node.irecv(j) for j in range(1, node.world_size)]
    parts = [inside.quantize_own(stream)]
    for h in got:
        buf = h.wait()
        assert buf is not None
        parts.append(decode_or_empty(buf, size, dtype, device, inside))
    total = SparseStream.sum(parts)
    # Step 2: the leaders' sparse allreduce of the node sums.
    if topo.num_nodes > 1:
        leaders = comm.subgroup(topo.leaders())
        total = get_algorithm(inner)(total, leaders, inner_codec(codec, own=False))
    # Step 3: the result to the node's other ranks, exactly (every rank the same bits).
    buf = encode_or_empty(total, inside, exact=True)
    for h in [node.isend(buf, j) for j in range(1, node.world_size)]:
        h.wait()
    return total


# twolevel_leader+ssar_split_allgather, twolevel_leader+dsar_split_allgather: auto's other inners
register_inner_variants("twolevel_leader", cost)
