"""DSAR_Split_allgather: sparse split phase, then dense allgather (paper 000, sec. 5.3.3).

For the dynamic case, where the reduced result ``K`` passes ``delta`` and every
reduced range will be dense anyway.

Steps:

1. Split the index space into ``P`` ranges; send range ``j`` of the local
   stream to rank ``j``, sparse (non-blocking, destinations rotated).
2. Rank ``j`` sums the pieces of its range, in rank order, and switches the
   result to the dense representation.
3. Dense allgather of the reduced ranges (the backend's optimised one; ranges
   padded to the largest, ``ceil(N/P)``, so unequal ranges fit).

Cost, with ``L2(P) = (P-1) alpha + log2(P) alpha`` (the paper's: the split's
``P-1`` messages, then a recursive-doubling allgather):

    L2(P) + (P-1)/P N beta_d  <=  T_dsar_split_ag  <=  L2(P) + k beta_s + (P-1)/P N beta_d

As built, step 3 is the backend's allgather: a ring with gloo and the generic
communicator, ``(P-1) alpha`` instead of ``log2(P) alpha``, so the latency term
is ``2 (P-1) alpha``; the bandwidth terms are the paper's.

At most ``2/kappa`` times faster than a dense allreduce (Lemma 5.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator, resolve
from ..errors import WireFormatError
from ..stream import SparseStream
from ._common import split_and_reduce, split_cost
from .codec import EXACT, StreamCodec
from .registry import register

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["dsar_split_allgather"]


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """``T_split``, then the backend's ring allgather of the dense ranges."""
    return (
        split_cost(model, p, n, ks, isize)
        + (p - 1) * model.alpha
        + (p - 1) / p * n * isize * model.beta
    )


@register(
    "dsar_split_allgather",
    auto=True,
    cost=cost,
    quadratic=True,
    auto_priority=2,
    header_in_first_round=True,
    dense_result=True,
)
def dsar_split_allgather(
    stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
) -> SparseStream:
    """Sum of every rank's ``stream`` by sparse split and dense allgather; same bits everywhere.

    Args:
        stream: this rank's vector (same size and dtype on every rank).
        comm: the communicator (default: the default process group, or a world of one).
        codec: with a quantizer, phase 3 sends each reduced range quantized (SparCML
            sec. 6) and every rank, the owner included, uses the dequantized ranges
            (the payloads padded to the largest, so the backend's allgather carries
            them).

    Returns:
        The sum as a dense stream, on ``stream``'s device.
    """
    comm = resolve(comm)
    p = comm.world_size
    if p == 1:
        return SparseStream.dense(stream.to_dense().clone())
    # Steps 1-2: sparse split, reduce, switch to dense.
    mine, bounds, _ = split_and_reduce(stream, comm, codec)
    widths = [bounds[j + 1] - bounds[j] for j in range(p)]
    if codec.quantizes_sums:
        # Step 3, quantized: every range's payload size follows from its width (the
        # quantizer's format), so the backend's allgather of payloads padded to the
        # largest does it in one collective; every rank decodes the same bytes.
        assert codec.quantizer is not None
        sizes = [codec.quantizer.expected_nbytes(w) for w in widths]
        payload = codec.encode_dense(mine.to_dense())
        if payload.numel() != sizes[comm.rank]:
            raise WireFormatError(
                f"{codec.quantizer.name}: a payload of {payload.numel()} bytes for "
                f"{widths[comm.rank]} values, its format says {sizes[comm.rank]}"
            )
        padded = payload
        if payload.numel() < max(sizes):
            padded = torch.zeros(max(sizes), dtype=torch.uint8, device=payload.device)
            padded[: payload.numel()] = payload
        ranges = [
            codec.decode_dense(buf[:size], w, stream.dtype, stream.device)
            for buf, size, w in zip(comm.allgather(padded), sizes, widths, strict=True)
        ]
        return SparseStream.dense(torch.cat(ranges))
    width = max(widths)
    padded = torch.zeros(width, dtype=stream.dtype, device=stream.device)
    padded[: widths[comm.rank]] = mine.to_dense()
    # Step 3: dense allgather of the reduced ranges.
    gathered = comm.allgather(padded)
    return SparseStream.dense(torch.cat([g[:w] for g, w in zip(gathered, widths, strict=True)]))
