r"""Whole sparse allreduce calls for several sizes of the eager first message, in one job.

Issue 35, item 1: over gloo every sparcml message is a first message of
``EAGER_BYTES`` (length word and the payload's start) and, when longer, a body whose
receive is posted once the length is in: one round trip more, and a body that waits
for its receiver to look. Does a larger first message bring ``ssar_split_allgather``
and ``ssar_recursive_double`` nearer gloo's own collectives for the same bytes?
Run as the ranks of a torch.distributed job (P = 2 for the exchange floor row)::

    sparcml cluster -P 2 --rate 1gbit -- .venv/bin/python benchmarks/eager_size.py \
        -N 16M -d 0.00781 --calls 21

Every round runs each row once (:class:`transport_floor.Rounds`: after a barrier,
the slowest rank's time): gloo's ``all_to_all_single`` and
``all_gather_into_tensor`` of the split allgather's bytes, at P = 2 one
``irecv``/``isend`` exchange of recursive doubling's bytes, and both algorithms with
first messages of 256 KiB (the library's before), 1 MiB (its size now up to P = 9,
:func:`sparcml.comm.torchdist.eager_bytes`) and 4 MiB, every rank switching its
communicator's ``eager_bytes`` together. Rank 0 prints each row's p50, min and max.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from transport_floor import Rounds, gloo_job  # this folder, on sys.path when run as a script

import sparcml.comm.torchdist as torchdist
from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.compress.selection import k_of
from sparcml.indexcode import index_field_nbytes

SIZES = (torchdist.EAGER_BYTES, 1024 * 1024, 4096 * 1024)  # 256 KiB, 1 MiB, 4 MiB


def main() -> None:
    args, comm = gloo_job(__doc__, calls=21)
    p, me = comm.world_size, comm.rank
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    stream = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
    rows = Rounds()

    def pairs_nbytes(size: int, nnz: int) -> int:  # a message's index field and values
        return index_field_nbytes(size, nnz) + 4 * nnz

    width = n // p
    reduced = round(width * (1 - (1 - args.density) ** p))  # expected union of one range
    piece = torch.zeros(pairs_nbytes(width, k // p), dtype=torch.uint8)
    split_in, split_out = piece.repeat(p), torch.empty(p * piece.numel(), dtype=torch.uint8)
    mine = torch.zeros(pairs_nbytes(width, reduced), dtype=torch.uint8)
    gathered = torch.empty(p * mine.numel(), dtype=torch.uint8)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    rows.add(
        f"floor: gloo all_to_all_single, {piece.numel() * (p - 1) / 1e6:.2f} MB out",
        lambda: dist.all_to_all_single(split_out, split_in),
    )
    rows.add(
        f"floor: gloo all_gather_into_tensor, {mine.numel() / 1e6:.2f} MB per rank",
        lambda: all_gather(gathered, mine),
    )
    if p == 2:
        send = torch.zeros(pairs_nbytes(n, k), dtype=torch.uint8)
        recv = torch.empty_like(send)

        def exchange() -> None:
            for work in [dist.irecv(recv, 1 - me), dist.isend(send, 1 - me)]:
                work.wait()

        rows.add(f"floor: gloo irecv + isend, {send.numel() / 1e6:.2f} MB", exchange)

    library = comm.eager_bytes

    def call(eager: int, algorithm: str) -> Callable[[], object]:
        def run() -> object:
            comm.eager_bytes = eager
            try:
                return sparse_allreduce(stream, comm, algorithm)
            finally:
                comm.eager_bytes = library

        return run

    for algorithm in ("ssar_split_allgather", "ssar_recursive_double"):
        for eager in SIZES:
            rows.add(f"{algorithm}, first message {eager // 1024} KiB", call(eager, algorithm))
    if me == 0:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"P={p} N={n:,} k={k:,} per rank, {args.calls} rounds; load average {load}")
    rows.run(args.calls)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
