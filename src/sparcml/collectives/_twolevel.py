"""What the two-level algorithms share: the node and lane groups, the inner
algorithm between nodes, and the codec each level sends with.

The two-level algorithms (``twolevel_shard``, ``twolevel_leader``) compose a
reduction inside every node with a flat sparse allreduce between nodes, as
SparCML's production run did (paper 000, sec. 8: NCCL inside each node,
SparCML between nodes). The topology is the communicator's
(:attr:`~sparcml.comm.Communicator.topology`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..comm import Communicator
from ..comm.abort import mark_uniform
from ..costmodel import expected_fill_in
from .codec import EXACT, StreamCodec
from .registry import algorithm_info, register_variant

if TYPE_CHECKING:
    from ..costmodel import CostModel
    from ..stream import SparseStream

__all__ = [
    "DEFAULT_INNER",
    "INNERS",
    "check_inner",
    "inner_codec",
    "inner_cost",
    "node_and_lane",
    "node_ks",
    "node_shape",
    "register_inner_variants",
]

#: The flat algorithm between nodes unless ``inner=`` names another: latency-optimal
#: (``log2`` of the number of nodes rounds), and with few nodes it moves what the
#: split allgather moves.
DEFAULT_INNER = "ssar_recursive_double"

#: The flat algorithms ``auto`` may run between nodes, the default first. With many
#: nodes the node sums fill in, and the dynamic split allgather (its pieces switch
#: to dense past ``delta``) moves the fewest bytes; recursive doubling's later
#: rounds carry the filled-in sums whole. (The dense allreduce is left to
#: ``dsar_split_allgather``'s dense pieces: it cannot quantize.)
INNERS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather")


def check_inner(name: str) -> None:
    """Refuse an ``inner=`` that is not a flat exact algorithm taking a stream (the
    same on every rank: the options are the call's own)."""
    try:
        info = algorithm_info(name)
    except ValueError as e:
        raise mark_uniform(ValueError(f"inner={name!r}: {e}"), True) from None
    if info.two_level or not info.exact or info.input != "stream" or info.options:
        raise mark_uniform(
            ValueError(
                f"inner={name!r} cannot run between nodes: it must be a flat exact "
                "algorithm that takes a stream and no options (ssar_recursive_double, "
                "ssar_split_allgather, dsar_split_allgather, or dense without a quantizer)"
            ),
            True,
        )


def register_inner_variants(base: str, cost: Callable[..., float]) -> None:
    """Register ``base+inner`` = ``base(inner=inner)`` for every other inner algorithm of
    :data:`INNERS`, with ``base``'s facts and ``cost(..., inner=inner)`` as its cost,
    so that ``auto`` can choose the algorithm between nodes (its model picks the
    inner of each two-level algorithm; measurement picks among the algorithms)."""
    info = algorithm_info(base)
    summary = info.summary.rstrip(".").split(";")[0]
    for inner in INNERS:
        if inner != DEFAULT_INNER:
            fn = _variant(info.fn, inner, f"{summary}, with ``{inner}`` between nodes.")
            partial = functools.partial(cost, inner=inner)
            dense = algorithm_info(inner).dense_result  # between nodes, the result's form
            register_variant(base, f"{base}+{inner}", fn, partial, dense_result=dense)


def _variant(fn: Callable[..., SparseStream], inner: str, doc: str) -> Callable[..., SparseStream]:
    def variant(
        stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
    ) -> SparseStream:
        return fn(stream, comm, codec, inner=inner)

    variant.__doc__ = doc
    variant.__name__ = variant.__qualname__ = f"{fn.__name__}_{inner}"
    return variant


def node_and_lane(comm: Communicator) -> tuple[Communicator, Communicator]:
    """This rank's node (the ranks sharing its node) and lane (the ranks with its
    local rank on every node) as communicators over ``comm``'s links."""
    topo = comm.topology
    return comm.subgroup(topo.node_ranks(comm.rank)), comm.subgroup(topo.lane_ranks(comm.rank))


def inner_codec(codec: StreamCodec, own: bool) -> StreamCodec:
    """The codec between nodes. ``own``: what this rank sends there is its own
    contribution (one rank per node), else a partial sum of the node's ranks. Under
    ``quantize="contributions"`` partial sums travel exactly (SparCML's Alg. 1), so
    the inner algorithm gets the exact codec; otherwise the call's codec."""
    if own or codec.quantizer is None or codec.quantize != "contributions":
        return codec
    return StreamCodec(None, "dense", codec.sequence, codec.index_coding, codec.rank)


def node_shape(model: CostModel, p: int) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of ``P`` ranks on contiguous nodes of
    ``model.ranks_per_node`` ranks (every rank its own node where that does not
    divide ``P``)."""
    per = min(max(model.ranks_per_node, 1), p)
    nodes = p // per if p % per == 0 else p
    return nodes, p // nodes


def node_ks(ks: Sequence[int], size: int, per_node: int) -> list[float]:
    """Expected nnz of each node's sum, for the ranks' nnz ``ks`` in rank order on
    contiguous nodes of ``per_node`` ranks (Appendix B.1's fill-in per node)."""
    return [expected_fill_in(size, ks[i : i + per_node]) for i in range(0, len(ks), per_node)]


def inner_cost(
    model: CostModel, nodes: int, size: int, ks: Sequence[float], isize: int, name: str
) -> float:
    """The inner algorithm's predicted seconds between ``nodes`` nodes (0 for one)."""
    if nodes <= 1:
        return 0.0
    cost = algorithm_info(name).cost
    assert cost is not None
    return cost(model, nodes, size, [round(k) for k in ks], isize)
