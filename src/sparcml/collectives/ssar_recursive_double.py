"""SSAR_Recursive_double: static sparse allreduce by recursive doubling (paper 000, sec. 5.3.1).

Steps (``P'`` = largest power of two ``<= P``; Appendix A for ``P != P'``):

0. Fold: rank ``r >= P'`` sends its stream to rank ``r - P'``, which adds it.
1. For ``t = 1 .. log2(P')``: exchange the partial sum with rank ``r XOR 2^(t-1)``
   and add the two (lower rank's operand first, so both partners compute the
   same bits); the partial sum switches to dense once it passes ``delta``.
2. Unfold: rank ``r < P - P'`` sends the result to rank ``r + P'``.

Cost (``k`` pairs per rank, ``P`` a power of two), with ``L1(P) = log2(P) alpha``:

    L1(P) + log2(P) k beta_s  <=  T_ssar_rec_dbl  <=  L1(P) + (P-1) k beta_s

the lower bound when all index sets coincide, the upper when they are disjoint.
``P != P'`` (Appendix A) adds ``2 alpha`` and, on the ranks that unfold, the
result's ``K <= P k`` pairs. Latency-optimal, best when the reduced result is small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator, resolve
from ..stream import SparseStream
from ._common import fold_messages, held_ranks, largest_power_of_two
from .codec import EXACT, CarriedHeaders, StreamCodec
from .registry import register

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["ssar_recursive_double"]


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """The bounds above under the expected fill-in of uniform indices (Appendix B):
    stage ``t`` sends the partial sum of ``2^(t-1)`` ranks' streams and merges it."""
    k = max(ks) if ks else 0
    # (clamped: callers pass mean shares of a range, which may round above its size;
    # 1 - k/n below zero to a fractional power would be complex)
    k_mean = min(sum(ks) / len(ks), n) if ks else 0.0
    p2 = largest_power_of_two(p)
    t = fold_messages(p) * model.message_time(k, n, isize)
    group = p / p2
    while group < p:
        held = n * (1.0 - (1.0 - k_mean / n) ** group) if n else 0.0
        t += model.message_time(held, n, isize) + model.gamma * 2 * min(held, n)
        group *= 2
    return t


@register("ssar_recursive_double", auto=True, cost=cost, auto_priority=0, header_in_rounds=True)
def ssar_recursive_double(
    stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
) -> SparseStream:
    """Sum of every rank's ``stream`` by recursive doubling; same bits on every rank.

    Args:
        stream: this rank's vector (same size and dtype on every rank).
        comm: the communicator (default: the default process group, or a world of one).
        codec: how messages are encoded (exact by default). With a lossy codec each
            partner adds the decoded copy of its own message, so both hold the same bits.
            With ``codec.first_round`` (a call through ``sparse_allreduce``) every
            message also carries the consistency headers its sender holds
            (:class:`~sparcml.collectives.codec.CarriedHeaders`): the check costs
            no rounds of its own, ``24 * 2^(t-1)`` bytes more in stage ``t``.

    Returns:
        The sum, on ``stream``'s device.
    """
    comm = resolve(comm)
    p, me = comm.world_size, comm.rank
    if p == 1:
        return stream.clone()
    p2 = largest_power_of_two(p)
    first, codec.first_round = codec.first_round, None
    headers = CarriedHeaders(first, me, stream.device)
    others = [r for r in range(p) if r != me]

    def decode(buf: torch.Tensor) -> SparseStream:
        return codec.decode(buf, stream.size, stream.dtype, stream.device)

    # Step 0: fold.
    if me >= p2:
        out = None if headers.refuse else codec.encode(stream)
        # (sendrecv: the partner's abort note is seen while the send waits for it)
        sent = headers.wrap([me], out)
        # (its partner answers in the unfold: not an exchange)
        got = headers.unwrap(comm.sendrecv(sent, me - p2, exchange=False), me - p2, others)
        headers.finish(p)
        assert got is not None
        return decode(got)
    acc = stream
    if me < p - p2:
        got = headers.unwrap(comm.recv(me + p2), me + p2, [me + p2])
        if got is not None:
            acc = codec.quantize_own(acc) + decode(got)
    # Step 1: log2(P') exchange-and-add stages.
    mask = 1
    while mask < p2:
        partner = me ^ mask
        partial = acc is not stream  # a sum of several ranks' contributions
        # both ranks of this rank's group hold the same partial sum: they must
        # quantize it alike, so the seed names the stage and the group (a rank's
        # own contribution, under quantize="contributions", uses its own generator)
        shared = codec.quantizes_sums and codec.lossy
        seed = codec.shared_seed(mask, me // mask) if shared else None
        buf = None if headers.refuse else codec.encode(acc, seed, partial=partial)
        got = headers.unwrap(
            comm.sendrecv(headers.wrap(held_ranks(me, mask, p, p2), buf), partner),
            partner,
            held_ranks(partner, mask, p, p2),
        )
        if got is not None:
            assert buf is not None
            other = decode(got)
            acc = codec.roundtrip(acc, buf, partial=partial)
            acc = other + acc if partner < me else acc + other
        mask <<= 1
    # Step 2: unfold (the final result travels exactly).
    if me < p - p2:
        final = None if headers.refuse else codec.encode_exact(acc)
        comm.send(headers.wrap([r for r in range(p) if r != me + p2], final), me + p2)
    headers.finish(p)
    return acc if acc is not stream else stream.clone()
