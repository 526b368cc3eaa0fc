"""Two-level leader-based sparse allreduce: to one rank per node, between leaders, back.

The plain composition of SparCML's production run (paper 000, sec. 8): each
node reduces to one rank, the nodes' leaders run the sparse allreduce, and each
leader hands the result to its node. Kept for comparison with the
shard-parallel arrangement (``twolevel_shard``), which keeps every rank of a
node busy; here one rank per node does the inter-node work.

With ``L`` ranks per node and ``n`` nodes:

1. Reduce to the leader (the node's lowest rank) by a binomial tree inside the
   node: for ``d = 1, 2, 4, ...`` local rank ``l`` with ``l mod 2d = d`` sends its
   (partial) sum to ``l - d``, which adds it to its own (its own first); the
   leader receives ``ceil(log2 L)`` messages instead of ``L - 1``, and the node's
   merging is spread over its ranks.
2. The leaders run a flat sparse allreduce (``inner``, default recursive
   doubling, sec. 5.3.1) of their node sums; the NIC carries one rank's traffic.
3. Broadcast inside the node down the same tree: the leader sends the result,
   exactly encoded, to its children, and every rank forwards the bytes it
   received before decoding them (``ceil(log2 L)`` rounds instead of ``L - 1``
   sends from the leader).

The trees are this library's arrangement (paper 000 sec. 8 says only that the
node reduces first); a direct fan-in and fan-out would cost ``L - 1`` messages on
the leader each way.

Cost, with inside-node pair ``(alpha_i, beta_i)``, the fill-in ``K_j`` of ``2^j``
ranks' streams, the node fill-in ``K_node`` and the total fill-in ``K``:

    T = sum_{j < log2 L} [(alpha_i + K_j beta_i) + 2 gamma K_j]
        + T_inner(n; K_node, alpha, beta) + log2(L) (alpha_i + K beta_i)

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
from ._common import decode_or_empty, encode_or_empty, log2_ceil
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
    inside = model.inside(elias_fano=False)  # the node's messages: fixed index fields
    levels = log2_ceil(per)
    t = 0.0
    for j in range(levels):  # step 1: the partial sums of 2^j ranks climb a level
        k_j = expected_fill_in(n, ks[: 1 << j]) if ks else 0.0
        t += inside.message_time(k_j, n, isize) + model.gamma * 2 * k_j
    t += inner_cost(model.for_topology(1), nodes, n, node_ks(ks, n, per), isize, inner)
    return t + levels * inside.message_time(expected_fill_in(n, ks), n, isize)


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
    me, per = node.rank, node.world_size
    # Step 1: the node's sum up a binomial tree to the leader (local rank 0).
    acc, combined = stream, False  # combined: acc holds other ranks' streams too
    d = 1
    while d < per:
        if me % (2 * d) == d:
            node.send(encode_or_empty(acc, inside, partial=combined), me - d)
            break
        if me + d < per:
            other = decode_or_empty(node.recv(me + d), size, dtype, device, inside)
            if not combined:
                acc, combined = inside.quantize_own(acc), True
            acc = SparseStream.sum([acc, other])
        d *= 2
    if me == 0:
        # Step 2: the leaders' sparse allreduce of the node sums (L >= 2: combined).
        if topo.num_nodes > 1:
            leaders = comm.subgroup(topo.leaders())
            acc = get_algorithm(inner)(acc, leaders, inner_codec(codec, own=False))
        buf = encode_or_empty(acc, inside, exact=True)
    else:
        buf = node.recv(me - (me & -me))  # step 3 from the rank this one sent to
    # Step 3: the result down the same tree, exactly: forward the bytes, then decode.
    d = ((me & -me) if me else 1 << (per - 1).bit_length()) // 2
    sends = []
    while d >= 1:
        if me + d < per:
            sends.append(node.isend(buf, me + d))
        d //= 2
    total = acc if me == 0 else decode_or_empty(buf, size, dtype, device)
    for h in sends:
        h.wait()
    return total


# twolevel_leader+ssar_split_allgather, twolevel_leader+dsar_split_allgather: auto's other inners
register_inner_variants("twolevel_leader", cost)
