"""SparCML's concatenating sparse allgather by recursive doubling (paper 000, sec. 5.3.1-5.3.2).

Every rank contributes one sparse stream (sizes may differ, empty allowed);
every rank receives all of them, in rank order.

Steps (``P'`` = largest power of two ``<= P``; Appendix A for ``P != P'``):

0. Fold: rank ``r >= P'`` hands its stream to rank ``r - P'``.
1. For ``t = 1 .. log2(P')``: exchange everything gathered so far with the rank
   at distance ``2^(t-1)`` (``r XOR 2^(t-1)``) and concatenate; the message
   doubles every stage.
2. Unfold: rank ``r < P - P'`` sends the complete set to rank ``r + P'``.

Cost (``k`` pairs per rank, ``P`` a power of two):
``T = log2(P) alpha + (P-1) k beta_s`` — each rank receives the other ``P-1``
streams exactly once. ``P != P'`` adds ``2 alpha`` and, on the ranks that unfold,
the ``P k beta_s`` of handing the whole result back.
"""

from __future__ import annotations

import torch

from ..comm import Communicator, resolve
from ..comm.engine import Work
from ..errors import WireFormatError
from ..stream import SparseStream
from ..wire import pack, unpack
from ._common import largest_power_of_two
from ._twolevel import node_and_lane
from .codec import EXACT, StreamCodec

__all__ = [
    "allgather_buffers",
    "allgather_buffers_on_nodes",
    "gather_streams",
    "sparse_allgather",
]


def allgather_buffers(buf: torch.Tensor, comm: Communicator) -> list[torch.Tensor]:
    """Recursive-doubling allgather of one byte buffer per rank (steps 0-2 above)."""
    p, me = comm.world_size, comm.rank
    if p == 1:
        return [buf]
    p2 = largest_power_of_two(p)
    held: dict[int, torch.Tensor] = {me: buf}

    def merge(bundle: torch.Tensor) -> None:
        for owner, data in unpack(bundle, p):
            if owner in held:
                raise WireFormatError(f"rank {me}: received rank {owner}'s block twice")
            held[owner] = data

    def bundle() -> torch.Tensor:
        return pack(sorted(held.items()))

    # Step 0: fold the ranks beyond the power of two onto their partners.
    if me >= p2:
        mine = bundle()
        held.clear()
        # (sendrecv: the partner's abort note is seen while the send waits for it)
        merge(comm.sendrecv(mine, me - p2, exchange=False))  # (answered in the unfold)
    else:
        if me < p - p2:
            merge(comm.recv(me + p2))
        # Step 1: recursive doubling among the first P' ranks.
        mask = 1
        while mask < p2:
            merge(comm.sendrecv(bundle(), me ^ mask))
            mask <<= 1
        # Step 2: unfold.
        if me < p - p2:
            comm.send(bundle(), me + p2)
    if len(held) != p:
        missing = sorted(set(range(p)) - set(held))
        raise WireFormatError(f"rank {me}: allgather finished without ranks {missing}")
    return [held[r] for r in range(p)]


def allgather_buffers_on_nodes(buf: torch.Tensor, comm: Communicator) -> list[torch.Tensor]:
    """:func:`allgather_buffers` in two levels where the ranks span several nodes of
    several ranks each (:attr:`~sparcml.comm.Communicator.topology`; beyond the paper):

    1. between nodes: the ranks of this rank's lane (its local rank on every node)
       gather their blocks, so each NIC carries each of its node's blocks to the
       other nodes once, one lane per local rank;
    2. inside the node: the node's ranks gather the lanes' bundles.

    Flat (:func:`allgather_buffers`) on one node or one rank per node. Returns the
    ``P`` blocks in rank order, as :func:`allgather_buffers`.
    """
    topo = comm.topology if comm.world_size > 1 else None
    if topo is None or topo.is_flat:
        return allgather_buffers(buf, comm)
    node, lane = node_and_lane(comm)
    # Step 1: this lane's blocks, in node order.
    across = allgather_buffers(buf, lane)
    # Step 2: every lane's blocks inside the node.
    bundles = allgather_buffers(pack(list(enumerate(across))), node)
    out: list[torch.Tensor | None] = [None] * comm.world_size
    for local, bundle in enumerate(bundles):
        for m, data in unpack(bundle, topo.num_nodes):
            out[topo.nodes[m][local]] = data
    missing = [r for r, b in enumerate(out) if b is None]
    if missing:
        raise WireFormatError(f"rank {comm.rank}: allgather on nodes finished without {missing}")
    return [b for b in out if b is not None]


def sparse_allgather(
    stream: SparseStream, comm: Communicator | None = None, async_op: bool = False
) -> list[SparseStream] | Work:
    """Gather every rank's sparse stream on every rank (recursive doubling; in two levels on nodes).

    Args:
        stream: this rank's contribution; sizes may differ between ranks, all
            ranks must use the same value dtype.
        comm: the communicator (default: the default process group, or a world of one).
        async_op: return a :class:`~sparcml.comm.engine.Work` at once and run on the
            communicator's background engine (in submission order).

    Returns:
        The ``P`` streams in rank order, on ``stream``'s device (or a ``Work``
        whose ``wait()`` returns them). The concatenation of disjoint ranges is
        :meth:`SparseStream.concat` of this list.

    Raises:
        WireFormatError: a peer sent a corrupt message or another dtype.

    Example:
        >>> from sparcml.comm import run_ranks
        >>> def fn(comm):
        ...     s = SparseStream(torch.tensor([comm.rank]), torch.ones(1), 4)
        ...     return [x.indices.tolist() for x in sparse_allgather(s, comm)]
        >>> run_ranks(2, fn)[0]
        [[0], [1]]
    """
    comm = resolve(comm)

    def call() -> list[SparseStream]:
        # checked inside the ordered call: its error is then this call's on every rank
        # (the others get the abort note at once instead of waiting out the timeout)
        if not isinstance(stream, SparseStream):
            # as the call its peers wait in (the next one): they get the note, and this
            # rank, which sent nothing yet, stays usable
            with comm.in_call(comm.sequence + 1):
                raise TypeError(
                    f"sparse_allgather expects a SparseStream, got {type(stream).__name__}"
                )
        return gather_streams(stream, comm)

    return comm.run_ordered(call, async_op)


def gather_streams(
    stream: SparseStream, comm: Communicator, codec: StreamCodec = EXACT, *, partial: bool = False
) -> list[SparseStream]:
    """The blocking allgather itself, for use inside other collectives.

    Every stream is what its message decodes to, so a lossy codec leaves every
    rank with the same values; this rank's own is not decoded again but taken as
    its receivers decode it (:meth:`StreamCodec.roundtrip`, a copy: never the
    caller's stream itself). ``partial``: the streams are partial sums, not the
    ranks' own contributions (see :mod:`.codec`). On ranks spanning several nodes
    of several ranks the bytes gather in two levels
    (:func:`allgather_buffers_on_nodes`: each block crosses the node's NIC once per
    other node instead of once per rank there); flat elsewhere.
    """
    buf = codec.encode(stream, partial=partial)
    bufs = allgather_buffers_on_nodes(buf, comm)
    own = codec.roundtrip(stream, buf, partial=partial)
    if own is stream:
        own = stream.clone()
    return [
        own if r == comm.rank else codec.decode(b, None, stream.dtype, stream.device)
        for r, b in enumerate(bufs)
    ]
