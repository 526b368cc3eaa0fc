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

Pipelined (beyond the paper): for a long vector (``N/P`` at least
:data:`PIPELINE_MIN_WIDTH`) and exact messages, each range is cut into
:data:`PIPELINE_CHUNKS` consecutive chunks and steps 1-3 run once per chunk,
interleaved: every chunk's pieces leave at once, chunk ``c`` is summed, encoded and
its allgather started while the next chunk's pieces travel, and chunk ``c``'s
gathered ranges are decoded while chunk ``c + 1``'s travel. The sums are the same
(every index is still added in rank order), so the result is bitwise that of the
unpipelined algorithm; the messages are ``PIPELINE_CHUNKS`` times as many, each
that much smaller. With a core per rank at 1 Gbit/s (P = 2, N = 16M, d = 0.78%)
it hides most of the encoding and decoding behind the wire (docs/cluster.md,
"Pipelining the split allgather").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator, resolve
from ..costmodel import expected_fill_in
from ..stream import SparseStream
from ._common import (
    Inbox,
    Receipt,
    allgather_cost,
    decode_or_empty,
    decode_ranges,
    encode_or_empty,
    partition_boundaries,
    split_and_reduce,
    split_cost,
)
from .codec import EXACT, HEADER_BYTES, StreamCodec
from .registry import register
from .sparse_allgather import allgather_buffers, allgather_exchanges, run_exchanges

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["PIPELINE_CHUNKS", "PIPELINE_MIN_WIDTH", "chunk_count", "ssar_split_allgather"]

PIPELINE_CHUNKS = 2
"""Chunks per range of a pipelined call. Measured at P = 2, 1 Gbit/s, N = 16M,
d = 0.78% (``benchmarks/transport_floor.py``): 2 and 3 chunks alike, 4 slower (each
chunk's messages and kernels carry their own fixed cost), 8 slower than none."""

PIPELINE_MIN_WIDTH = 1 << 20
"""Indices per range from which a call is pipelined: below, a chunk's messages are
too short for their transfer to hide a chunk's encoding and decoding."""


def chunk_count(size: int, world_size: int, codec: StreamCodec) -> int:
    """How many chunks a call of vectors of ``size`` cuts each range into: from
    what every rank's consistency header shares (the size, the quantizer), so that
    every rank sends and expects the same messages."""
    if codec.quantizer is not None or size // max(world_size, 1) < PIPELINE_MIN_WIDTH:
        return 1
    return PIPELINE_CHUNKS


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
    chunks = chunk_count(stream.size, comm.world_size, codec)
    if chunks > 1:
        return pipelined(stream, comm, codec, chunks)
    # Steps 1-2: split and reduce.
    mine, bounds, _ = split_and_reduce(stream, comm, codec)
    # Step 3: sparse allgather of the reduced ranges, then concatenation.
    bufs = allgather_buffers(codec.encode(mine, partial=True), comm)
    # decoded straight into the result (exact codec: one pass per range)
    return decode_ranges(codec, bufs, bounds, stream, comm.rank, "the gathered ranges")


def pipelined(
    stream: SparseStream, comm: Communicator, codec: StreamCodec, chunks: int
) -> SparseStream:
    """Steps 1-3 per chunk of every range, interleaved (module docstring); exact
    codecs only (a quantizer's scale would differ per chunk)."""
    assert codec.quantizer is None
    p, me = comm.world_size, comm.rank
    first, codec.first_round = codec.first_round, None
    bounds = partition_boundaries(stream.size, p)
    # range j's chunk c is [cuts[j * chunks + c], cuts[j * chunks + c + 1])
    cuts = [b + c * (e - b) // chunks for b, e in itertools.pairwise(bounds) for c in range(chunks)]
    cuts.append(stream.size)
    pieces = stream.split(cuts)
    inbox = Inbox(comm)
    sends = []
    dests = [(me + s) % p for s in range(1, p)]  # rotated, as the all-to-all's
    sources = [(me - s) % p for s in range(1, p)]
    empty = torch.empty(0, dtype=torch.uint8, device=stream.device)

    def width(j: int, c: int) -> int:
        return cuts[j * chunks + c + 1] - cuts[j * chunks + c]

    def send_pieces(c: int) -> dict[int, Receipt]:
        """Step 1 for chunk ``c``: this rank's piece of every other range leaves;
        the pieces of this rank's range are expected."""
        for j in dests:
            payload = empty if first is not None and first.refuse else None
            if payload is None:
                payload = encode_or_empty(pieces[j * chunks + c], codec)
            if first is not None and c == 0:  # the consistency header, in front
                payload = torch.cat([first.header.to(stream.device), payload])
            sends.append(comm.isend(payload, j))
        return {j: inbox.expect(j) for j in sources}

    received = [send_pieces(0)]
    got0: dict[int, torch.Tensor] = {}
    if first is not None:
        # every rank checks every header before using anything, and before sending
        # more: a mismatch (which may differ in the chunk count) leaves no message behind
        got0 = {j: r.wait() for j, r in received[0].items()}
        for h in sends:
            h.wait()
        first.ks = first.check(
            [first.header if j == me else got0[j][:HEADER_BYTES] for j in range(p)]
        )
        got0 = {j: b[HEADER_BYTES:] for j, b in got0.items()}
    received += [send_pieces(c) for c in range(1, chunks)]

    out: list[list[SparseStream | None]] = [[None] * chunks for _ in range(p)]
    gathering = []

    def decode_gathered(c: int) -> None:
        """Step 3's end for chunk ``c``: the other ranges' chunks, decoded."""
        bufs = run_exchanges(gathering[c])
        for j in sources:
            out[j][c] = decode_ranges(
                codec, [bufs[j]], [0, width(j, c)], stream, me, "the gathered ranges"
            )

    for c in range(chunks):
        # Step 2: this rank's range's chunk c, summed in rank order.
        w = width(me, c)
        parts = [
            pieces[me * chunks + c]
            if j == me
            else decode_or_empty(
                got0[j] if c == 0 and first is not None else received[c][j].wait(),
                w,
                stream.dtype,
                stream.device,
                codec,
            )
            for j in range(p)
        ]
        mine = out[me][c] = SparseStream.sum(parts)
        # Step 3: its allgather starts (the first exchange posted) ...
        gathering.append(allgather_exchanges(codec.encode(mine, partial=True), comm, inbox.expect))
        next(gathering[c])
        # ... while the chunk before's ranges are decoded.
        if c:
            decode_gathered(c - 1)
    decode_gathered(chunks - 1)
    for h in sends:
        h.wait()
    return SparseStream.concat([s for row in out for s in row if s is not None])
