"""Squared error of the mean under each ``quantize`` mode, per algorithm.

P in-process ranks quantize the same vector (N = 4096 standard normals) and
average it with ``sparse_allreduce(..., quantize=mode)``; prints the squared
error of the mean, summed over entries and averaged over trials, next to the
error of one quantization divided by P (what independent rounding gives).

    .venv/bin/python examples/quantize_modes.py [--trials 8]
"""

from __future__ import annotations

import argparse

import torch

from sparcml import SparseStream, compress, sparse_allreduce
from sparcml.comm import run_ranks

ALGORITHMS = ["ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "topka"]
MODES = ["contributions", "dense", "all"]


def error_of_mean(x: torch.Tensor, world: int, alg: str, q: str, mode: str, trials: int) -> float:
    total = 0.0
    for t in range(trials):

        def fn(comm, t=t):  # type: ignore[no-untyped-def]
            for _ in range(t):
                comm.next_sequence()
            s = SparseStream.dense(x.clone())
            out = sparse_allreduce(s, comm, algorithm=alg, quantizer=compress.get(q), quantize=mode)
            return out.to_dense()

        total += float(((run_ranks(world, fn)[0] / world - x) ** 2).sum())
    return total / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--quantizers", default="natural,qsgd")
    ap.add_argument("--worlds", default="4,8")
    args = ap.parse_args()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    print("| quantizer | P | algorithm | one rounding / P | " + " | ".join(MODES) + " |")
    print("|---|---:|---|---:|" + "---:|" * len(MODES))
    for q in args.quantizers.split(","):
        op = compress.get(q, seed=7)
        payload, ctx = op.compress(x)
        single = float(((op.decompress(payload, ctx) - x) ** 2).sum())
        for world in (int(w) for w in args.worlds.split(",")):
            for alg in ALGORITHMS:
                errs = [error_of_mean(x, world, alg, q, m, args.trials) for m in MODES]
                cells = " | ".join(f"{e:.1f}" for e in errs)
                print(f"| {q} | {world} | {alg} | {single / world:.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
