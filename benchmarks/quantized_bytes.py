"""Bytes of natural's quantized allreduce on gradients with zeros (issue 13).

P in-process ranks, ``N`` float32 per rank, a fraction of each rank's entries
set to zero at random, reduced by ``sparse_allreduce(SparseStream.dense(x),
algorithm="dsar_split_allgather", quantizer="natural", quantize="all")`` as the
``natural`` training method does; prints the bytes each rank sent (mean over
ranks), next to the fp32 ring allreduce's ``2 (P-1)/P N 4``. Byte counts do not
depend on the machine's load.

    .venv/bin/python benchmarks/quantized_bytes.py -P 4 -N 1M
"""

from __future__ import annotations

import argparse

import torch

from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import Communicator, run_ranks
from sparcml.tools.cli.common import size_arg


def _rank(comm: Communicator, n: int, zeros: float) -> int:
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < zeros] = 0
    comm.stats.reset()
    sparse_allreduce(
        SparseStream.dense(x), comm, algorithm="dsar_split_allgather",
        quantizer="natural", quantize="all",
    )  # fmt: skip
    return comm.stats.bytes_sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", "--world-size", type=int, default=4)
    ap.add_argument("-N", "--size", type=size_arg, default=1 << 20)
    ap.add_argument("--zeros", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9])
    args = ap.parse_args()
    p, n = args.world_size, args.size
    ring = 2 * (p - 1) / p * n * 4
    print(f"P={p} N={n:,}; fp32 ring allreduce: {ring:,.0f} bytes per rank")
    for z in args.zeros:
        sent = run_ranks(p, _rank, n, z)
        print(f"zeros {z:4.0%}: natural sent {sum(sent) / p:12,.0f} bytes per rank")


if __name__ == "__main__":
    main()
