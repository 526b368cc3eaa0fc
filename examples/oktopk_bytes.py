"""Bytes per rank of Ok-Topk (steady state) and TopkA, in-process ranks, P = 2..16.

Run: .venv/bin/python examples/oktopk_bytes.py
"""

from __future__ import annotations

import torch

from sparcml import OkTopkState, SparseStream, oktopk_allreduce, sparse_allreduce
from sparcml.comm import run_ranks

N, K = 20_000, 200


def rank(comm):  # type: ignore[no-untyped-def]
    state = OkTopkState(tau=1000, tau_prime=1000)
    sent = []
    for step in range(3):  # step 0 computes thresholds and boundaries, 1-2 reuse them
        acc = torch.randn(N, generator=torch.Generator().manual_seed(comm.rank + 100 * step))
        before = comm.stats.bytes_sent
        oktopk_allreduce(acc, K, comm, state)
        sent.append(comm.stats.bytes_sent - before)
    top = torch.topk(acc.abs(), K).indices
    before = comm.stats.bytes_sent
    sparse_allreduce(SparseStream(top, acc[top], N), comm, algorithm="topka")
    return max(sent[1:]), comm.stats.bytes_sent - before


print(f"N={N} k={K} float32; largest rank's bytes per call")
head = ("P", "oktopk", "6k(P-1)/P words", "ratio", "topka", "2k(P-1) words")
print(f"{head[0]:>3} {head[1]:>8} {head[2]:>16} {head[3]:>6} {head[4]:>8} {head[5]:>14}")
for p in (2, 4, 8, 16):
    out = run_ranks(p, rank)
    ok, ta = max(o[0] for o in out), max(o[1] for o in out)
    bound = 6 * K * (p - 1) / p * 4
    print(f"{p:>3} {ok:>8} {bound:>16.0f} {ok / bound:>6.2f} {ta:>8} {2 * K * (p - 1) * 4:>14}")
