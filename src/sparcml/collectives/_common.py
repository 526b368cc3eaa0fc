"""Building blocks shared by the collectives (written once, used by several algorithms)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator
from ..errors import WireFormatError
from ..stream import SparseStream
from .codec import EXACT, HEADER_BYTES, StreamCodec

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = [
    "allgather_cost",
    "decode_or_empty",
    "decode_ranges",
    "encode_or_empty",
    "fold_messages",
    "held_ranks",
    "largest_power_of_two",
    "log2_ceil",
    "partition_boundaries",
    "split_and_reduce",
    "split_cost",
]


def largest_power_of_two(p: int) -> int:
    """The largest power of two ``<= p`` (``p >= 1``)."""
    return 1 << (p.bit_length() - 1)


def held_ranks(rank: int, mask: int, p: int, p2: int) -> list[int]:
    """The ranks whose contributions rank ``rank`` (< ``P'``) holds before the
    recursive-doubling round with ``mask`` (``P'`` = ``p2``): its group of ``mask``
    ranks and the extra ranks folded into them (Appendix A), ascending."""
    base = rank & ~(mask - 1)
    group = list(range(base, base + mask))
    return group + [r + p2 for r in group if r < p - p2]


def fold_messages(p: int) -> int:
    """Extra messages on the critical path when ``P`` is not a power of two (paper 000,
    Appendix A: fold the extra ranks in before, unfold after)."""
    return 0 if p == largest_power_of_two(p) else 2


def log2_ceil(p: int) -> int:
    """``ceil(log2 P)``: rounds of a recursive-doubling exchange."""
    return (p - 1).bit_length()


def split_cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """Cost of :func:`split_and_reduce`: ``P-1`` messages of about ``k/P`` pairs of an
    ``N/P`` range each, then the merge of about ``k`` pairs (paper 000, ``T_split``)."""
    k = max(ks) if ks else 0
    return (p - 1) * model.message_time(k / p, max(n // p, 1), isize) + model.gamma * k


def allgather_cost(model: CostModel, p: int, width: int, pairs: float, isize: int) -> float:
    """Cost of :func:`~.sparse_allgather.allgather_buffers` of one stream of ``pairs``
    pairs over ``width`` indices per rank: Appendix A's fold, then ``log2 P'`` rounds
    whose messages double (paper 000, sec. 5.3.1)."""
    t = fold_messages(p) * model.message_time(pairs, width, isize)
    copies = p / largest_power_of_two(p)
    while copies < p:
        t += model.message_time(pairs, width, isize, copies)
        copies *= 2
    return t


def decode_ranges(
    codec: StreamCodec,
    bufs: list[torch.Tensor],
    bounds: Sequence[int],
    like: SparseStream,
    rank: int,
    what: str,
    own: tuple[int, SparseStream] | None = None,
) -> SparseStream:
    """The concatenation of the gathered messages of consecutive ranges ``bounds``
    (the last step of the split-allgather algorithms), decoded straight into the
    result; a corrupt or mismatched message raises naming ``what`` was gathered.

    ``own``: ``(position, stream)`` of the range this rank reduced and sent, as its
    receivers decode it (:meth:`StreamCodec.roundtrip`): copied in, not decoded
    from its own message (beyond the paper: 1/P of the decoding saved)."""
    widths = [bounds[j + 1] - bounds[j] for j in range(len(bounds) - 1)]
    known = dict([own]) if own is not None else None
    try:
        return codec.decode_concat(bufs, widths, like.dtype, like.device, known)
    except WireFormatError as e:
        raise WireFormatError(f"rank {rank}: {what}: {e} (do all ranks pass the same N?)") from None


def partition_boundaries(size: int, parts: int) -> list[int]:
    """Boundaries ``b[j] = j*N // P`` of ``P`` contiguous index ranges.

    Appendix A of paper 000 gives every rank ``floor(N/P)`` indices and the
    remainder to the last; ``j*N // P`` is the same when ``P`` divides ``N`` and
    spreads the remainder (at most one extra index per range) otherwise, so
    ``N < P`` leaves some ranges empty instead of loading the last rank.
    """
    return [j * size // parts for j in range(parts + 1)]


def encode_or_empty(
    stream: SparseStream, codec: StreamCodec = EXACT, *, exact: bool = False
) -> torch.Tensor:
    """The message for ``stream`` (exact, in ``codec``'s index coding, with ``exact``),
    or a zero-length payload for a sparse stream with no entries."""
    if not stream.is_dense and stream.nnz == 0:
        return torch.empty(0, dtype=torch.uint8, device=stream.device)
    return codec.encode_exact(stream) if exact else codec.encode(stream)


def decode_or_empty(
    buf: torch.Tensor,
    size: int,
    dtype: torch.dtype,
    device: torch.device,
    codec: StreamCodec = EXACT,
) -> SparseStream:
    """Inverse of :func:`encode_or_empty`, checking size and dtype."""
    if buf.numel() == 0:
        return SparseStream.empty(size, dtype, device)
    return codec.decode(buf, size, dtype, device)


def split_and_reduce(
    stream: SparseStream,
    comm: Communicator,
    codec: StreamCodec = EXACT,
    bounds: list[int] | None = None,
) -> tuple[SparseStream, list[int], int]:
    """The split phase of the split-allgather algorithms (paper 000, sec. 5.3.2).

    1. Split the local stream into ``P`` index ranges (:func:`partition_boundaries`,
       or the given ``bounds``: Ok-Topk's balanced regions).
    2. Send range ``j`` to rank ``j`` directly, non-blocking, destinations rotated
       (zero-length payloads for empty ranges).
    3. Rank ``j`` sums the ``P`` pieces of its range in rank order (deterministic).

    With ``codec.first_round`` (an explicit call of an algorithm registered with
    ``header_in_first_round``), every message starts with this rank's consistency
    header, and every rank checks all headers before decoding anything.

    Cost: ``(P-1) alpha + [0, k] beta_s`` (``T_split``).

    Returns:
        This rank's reduced range (local indices), the boundaries, and the bytes
        this rank sent.
    """
    p, me = comm.world_size, comm.rank
    first, codec.first_round = codec.first_round, None
    if bounds is None:
        bounds = partition_boundaries(stream.size, p)
    # pieces quantized whatever their form leave that choice to the quantized
    # encoder, which counts by the quantized sizes (no float-sized sparsify first)
    pieces = stream.split(bounds, sparsify=not codec.quantizes_every_piece)
    empty = torch.empty(0, dtype=torch.uint8, device=stream.device)
    payloads = [
        empty if j == me or (first is not None and first.refuse) else encode_or_empty(piece, codec)
        for j, piece in enumerate(pieces)
    ]
    sent = sum(pl.numel() for pl in payloads)
    if first is not None:  # the consistency header in front of every message
        header = first.header.to(stream.device)
        payloads = [pl if j == me else torch.cat([header, pl]) for j, pl in enumerate(payloads)]
    received = comm.alltoallv(payloads)
    if first is not None:
        # every rank checks every header before using anything: the same error everywhere
        first.ks = first.check(
            [first.header if j == me else r[:HEADER_BYTES] for j, r in enumerate(received)]
        )
        received = [r[HEADER_BYTES:] for r in received]
    width = bounds[me + 1] - bounds[me]
    mine = [
        codec.quantize_own(pieces[me])
        if j == me
        else decode_or_empty(received[j], width, stream.dtype, stream.device, codec)
        for j in range(p)
    ]
    return SparseStream.sum(mine), bounds, sent
