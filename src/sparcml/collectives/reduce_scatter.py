"""Sparse reduce-scatter, flat or in two levels: rank ``r`` gets range ``r`` of the sum.

Flat, it is SparCML's split phase (paper 000, sec. 5.3.2: send range ``j`` to rank
``j``, which sums the pieces): :func:`~._common.split_and_reduce`. FSDP2's
reduce-scatter runs it with its chunk boundaries (:mod:`sparcml.torch.fsdp`).

On ranks that span several nodes of several ranks each
(:attr:`~sparcml.comm.Communicator.topology`), beyond the paper, in two levels so
that each node's NIC carries the node's sum once instead of every rank's
contribution:

1. Inside the node: local rank ``l`` receives, from every rank of its node, the
   ranges owned by the ranks of its lane (local rank ``l`` on every node), and
   sums them in local rank order (the split phase on the node's ranks, over the
   ranges reordered lane by lane).
2. Between nodes: the lane's ranks run the split phase on those ranges, each
   keeping its own.

Cost, ``L`` ranks per node, ``n`` nodes, ``k`` pairs per rank, ``K_node`` per node:
``T_split(L; k, alpha_i, beta_i) + T_split(n; K_node / L, alpha, L beta)``.
Under ``quantize="contributions"`` each rank's own pieces are quantized once (step 1)
and the node sums of step 2 travel exactly. Each rank writes only its own range.
"""

from __future__ import annotations

import itertools

from ..comm import Communicator
from ..stream import SparseStream
from ._common import partition_boundaries, split_and_reduce
from ._twolevel import inner_codec, node_and_lane
from .codec import EXACT, StreamCodec

__all__ = ["reduce_scatter"]


def reduce_scatter(
    stream: SparseStream,
    comm: Communicator,
    codec: StreamCodec = EXACT,
    bounds: list[int] | None = None,
) -> SparseStream:
    """This rank's range ``[bounds[r], bounds[r + 1])`` of the sum over ranks (local
    indices; default ranges :func:`~._common.partition_boundaries`). Two levels on a
    topology of several nodes of several ranks, else the flat split phase.

    Raises:
        ValueError: ``bounds`` is not ``P + 1`` ascending offsets from 0 to ``N``.
    """
    p = comm.world_size
    if bounds is not None and (
        len(bounds) != p + 1
        or bounds[0] != 0
        or bounds[-1] != stream.size
        or any(a > b for a, b in itertools.pairwise(bounds))
    ):
        raise ValueError(
            f"reduce_scatter: bounds must be {p + 1} ascending offsets from 0 to "
            f"N = {stream.size}, got {bounds}"
        )
    topo = comm.topology if p > 1 else None
    if topo is None or topo.is_flat:
        return split_and_reduce(stream, comm, codec, bounds)[0]
    if bounds is None:
        bounds = partition_boundaries(stream.size, p)
    first, codec.first_round = codec.first_round, None
    if first is not None:
        # a consistency header meant for a flat split's messages: every rank's, checked
        # on every rank before any data moves (one allgather)
        with comm.control():
            headers = comm.allgather(first.header.to(stream.device))
        first.ks = first.check(headers)
    node, lane = node_and_lane(comm)
    lanes = [[n[loc] for n in topo.nodes] for loc in range(topo.ranks_per_node)]
    # the ranges reordered lane by lane: local rank l's share is one contiguous block
    pieces = stream.split(bounds, sparsify=not codec.quantizes_every_piece)
    order = [r for members in lanes for r in members]
    reordered = SparseStream.concat([pieces[r] for r in order])
    widths = [bounds[r + 1] - bounds[r] for r in order]
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    per = topo.num_nodes
    lane_bounds = [offsets[loc * per] for loc in range(topo.ranks_per_node + 1)]
    # Step 1: the node's sum of this lane's ranges.
    mine, _, _ = split_and_reduce(reordered, node, codec, lane_bounds)
    # Step 2: the split phase between nodes; this rank keeps its own range.
    start = lane_bounds[node.rank]
    inner = [offsets[node.rank * per + m] - start for m in range(per + 1)]
    out, _, _ = split_and_reduce(mine, lane, inner_codec(codec, own=False), inner)
    return out
