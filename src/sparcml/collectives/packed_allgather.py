"""RedSync's packed sparse allgather (paper 002, sec. 3.4).

"Instead of using two Allgather operations for indices and values message
separately, we package the indices and values into a single message to reduce
latency." Each rank's message holds its exactly sent entries as one sparse
stream (slot 0 of a :func:`~sparcml.wire.pack` bundle) and one ASQ payload per
quantized layer (slot ``j + 1`` for layer ``j``: indices plus a mean, no signs).

Steps:

1. Pack this rank's message (a bare stream when there is no ASQ payload).
2. Allgather the messages (recursive doubling, sizes unknown in advance:
   :func:`~sparcml.collectives.sparse_allgather.allgather_buffers`).
3. Every rank decodes the ``P`` messages and adds them in rank order, so the
   sum has the same bits everywhere.

Cost (sec. 3.4's model, ``D`` the density averaged over ranks, ``M`` entries,
``isize + c`` bytes per pair): ``log2(P) alpha + (P-1) M D (isize + c) beta +
P M D gamma`` (decompression of ``P`` messages); with ASQ ``(P-1) M D c beta``.
Not an ``algorithm=`` of :func:`~sparcml.sparse_allreduce`: its input is a
packed per-layer message, not one stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import Communicator
from ..compress.asq import ASQ
from ..compress.base import Context
from ..errors import RankMismatchError
from ..stream import SparseStream
from ..wire import decode, encode, pack, unpack
from .sparse_allgather import allgather_buffers

__all__ = ["packed_allgather"]

_ASQ_DECODER = ASQ(k=1)  # decompress() only reads the payload


def packed_allgather(
    plain: SparseStream,
    asq_parts: Sequence[tuple[int, torch.Tensor]],
    offsets: Sequence[int],
    comm: Communicator,
) -> torch.Tensor:
    """Steps 1-3: the dense sum over ranks of every rank's packed message.

    Args:
        plain: this rank's exactly sent entries, over the whole bucket.
        asq_parts: ``(j + 1, payload)`` of every ASQ-quantized layer ``j``.
        offsets: the layers' boundaries in the bucket (``len(layers) + 1`` values).
        comm: the communicator.

    Raises:
        RankMismatchError: a rank's bucket has another size.
        WireFormatError: a malformed message.
    """
    n, dtype, device = plain.size, plain.dtype, plain.device
    # Step 1: slot 0 the exactly sent layers; slot j + 1 layer j's ASQ payload
    message = pack([(0, encode(plain)), *asq_parts]) if asq_parts else encode(plain)
    # Steps 2-3: allgather, decode, add in rank order
    total = torch.zeros(n, dtype=dtype, device=device)
    layers = len(offsets)
    for buf in allgather_buffers(message, comm):
        buf = buf.to(device)
        entries = unpack(buf, layers) if asq_parts else [(0, buf)]
        for slot, data in entries:
            if slot == 0:
                s = decode(data, device=device)
                if s.size != n:
                    raise RankMismatchError(
                        f"redsync: a rank sent a bucket of {s.size} entries, this rank has {n} "
                        "(do all ranks register the same parameters in the same order?)"
                    )
                if s.is_dense:
                    total += s.to_dense()
                elif s.nnz:
                    total[s.indices] += s.values.to(dtype)
            else:
                lo, hi = offsets[slot - 1], offsets[slot]
                ctx = Context((hi - lo,), dtype, device)
                total[lo:hi] += _ASQ_DECODER.decompress(data, ctx)
    return total
