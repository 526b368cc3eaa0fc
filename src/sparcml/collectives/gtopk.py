"""gTopk: global top-k by a reduction tree that re-selects at every level (Shi et al., ICDCS'19).

Steps (binomial tree, any ``P``):

1. ``k`` = the largest selection size over the ranks, or the selector's own ``k``
   where that is larger (one small allreduce; ``TopK`` leaves the zeros out of a
   tensor with fewer non-zeros than ``k``, so a selection may be smaller than ``k``).
2. Reduce: for ``d = 1, 2, 4, ...``: rank ``r`` with ``r mod 2d = d`` sends its
   current set to rank ``r - d`` and leaves; rank ``r - d`` adds the two sets
   (its own first) and keeps the top-k of the sum by magnitude.
3. Broadcast the root's top-k set back down the same tree.

Cost ``2 log2(P) alpha + 4k log2(P) beta`` (paper 001's table: ``k`` pairs up and
down each of the ``log2 P`` levels). The result is not the sum of the local
selections but the top-k of a top-k-filtered sum, which bounds the fill-in.

On ranks spanning several nodes (the ``node_aware`` fact; beyond paper 001) the
tree runs over the ranks in node order (node 0's ranks, then node 1's, ...), so
with ``L`` ranks per node (a power of two) its first ``log2 L`` levels stay
inside the node and only the last ``log2 M`` of ``M`` nodes cross, each level
one message per pair of nodes: the NIC is never shared. On contiguous nodes
that order is the ranks' own, and the result the flat tree's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator, resolve
from ..indexcode import index_field_nbytes
from ..stream import SparseStream
from ._common import log2_ceil
from .codec import EXACT, StreamCodec
from .registry import register

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["gtopk", "in_node_order", "keep_topk"]


def keep_topk(stream: SparseStream, k: int) -> SparseStream:
    """The ``k`` entries of largest magnitude of ``stream`` (all of them if fewer)."""
    if stream.is_dense:
        values = stream.values
        if k >= values.numel():
            return stream
        idx = torch.topk(torch.nan_to_num(values.abs(), nan=float("inf")), k).indices
        idx = torch.sort(idx).values
        return SparseStream.from_sorted(idx, values[idx], stream.size)
    if stream.nnz <= k:
        return stream
    mag = torch.nan_to_num(stream.values.abs(), nan=float("inf"))
    pos = torch.sort(torch.topk(mag, k).indices).values
    return SparseStream.from_sorted(stream.indices[pos], stream.values[pos], stream.size)


def in_node_order(comm: Communicator) -> Communicator:
    """``comm`` with its ranks renumbered node by node (node 0's ranks first, each
    node's in ascending order): ``comm`` itself where that is already its order."""
    order = tuple(r for node in comm.topology.nodes for r in node)
    return comm if order == tuple(range(comm.world_size)) else comm.subgroup(order)


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """Tree reduction keeping ``k`` per level, then broadcast (paper 001's table:
    ``2 log P alpha + 4k log P beta`` in words), a merge per level. On nodes of ``L =
    model.ranks_per_node`` ranks (a power of two) the first ``log2 L`` levels (up and
    down) cost the inside pair, the others the pair between nodes; with ``L`` not a
    power of two some early levels cross nodes, so every level is charged between
    nodes (an upper bound)."""
    k = max(ks) if ks else 0
    pair = index_field_nbytes(n, k) / max(k, 1) + isize  # indices as the wire codes them
    log_p = log2_ceil(p)
    lanes = model.ranks_per_node
    power_of_two = lanes > 1 and lanes & (lanes - 1) == 0
    inside_levels = (lanes.bit_length() - 1) if power_of_two and p % lanes == 0 else 0
    inside_levels = min(inside_levels, log_p)
    t = model.gamma * 2 * k * log_p
    t += 2 * (log_p - inside_levels) * (model.alpha + model.beta_pairs * k * pair)
    if inside_levels:
        inside = model.inside()
        t += 2 * inside_levels * (inside.alpha + inside.beta_pairs * k * pair)
    return t


@register("gtopk", exact=False, input="selection", cost=cost, family=("topk",), node_aware=True)
def gtopk(
    stream: SparseStream,
    comm: Communicator | None = None,
    codec: StreamCodec = EXACT,
    k: int | None = None,
) -> SparseStream:
    """Global top-k of the ranks' selections by gTopk's tree; same bits on every rank.

    Args:
        stream: this rank's selection (local top-k); its nnz may differ between ranks.
        comm: the communicator (default: the default process group, or a world of one).
        codec: how the reduce-phase messages are encoded (exact by default).
        k: the selector's ``k`` (the training pipeline passes it): the tree keeps
            ``max(k, the largest selection)`` entries; default the largest selection.
    """
    comm = resolve(comm)
    if k is not None and k < 0:
        raise ValueError(f"gtopk: k must be at least 0, got {k}")
    # Step 1: a common k
    mine = max(stream.nnz, k or 0)
    with comm.control():
        k = int(comm.allreduce(torch.tensor([mine], dtype=torch.int64), op="max"))
    if comm.world_size == 1:
        return keep_topk(stream, k).clone()
    comm = in_node_order(comm)  # the tree's first levels inside the nodes
    p, me = comm.world_size, comm.rank
    acc = keep_topk(stream, k)
    combined = False  # acc holds other ranks' contributions too
    # Step 2: reduce up the binomial tree
    d = 1
    sent = None
    while d < p:
        if me % (2 * d) == d:
            # waited for once the parent's broadcast came (step 3): on gloo a send
            # completes only when the peer receives, and a parent that failed sends
            # its abort note instead, which this rank then reads at once
            sent = comm.isend(codec.encode(acc, partial=combined), me - d)
            break
        if me % (2 * d) == 0 and me + d < p:
            other = codec.decode(comm.recv(me + d), stream.size, stream.dtype, stream.device)
            if not combined:
                acc, combined = codec.quantize_own(acc), True
            acc = keep_topk(acc + other, k)
        d *= 2
    # Step 3: broadcast the root's set down the same tree
    if me != 0:
        parent = me - (me & -me)  # the rank this one sent to
        acc = codec.decode(comm.recv(parent), stream.size, stream.dtype, stream.device)
        assert sent is not None
        sent.wait()
    low = (me & -me) if me else 1 << (p - 1).bit_length()
    d = low // 2
    while d >= 1:
        if me + d < p:
            comm.send(codec.encode_exact(acc), me + d)
        d //= 2
    return acc
