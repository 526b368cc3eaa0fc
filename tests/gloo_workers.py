"""Rank functions for the spawned-gloo tests (module level, so child processes import them)."""

from __future__ import annotations

import os
import time

import torch

from inputs import make_stream
from sparcml import SparseStream, algorithms, sparse_allreduce
from sparcml.errors import CommError, RankMismatchError
from sparcml.wire import encode

CASES = [
    (97, "random", torch.float32),
    (13, "overlap", torch.float64),
    (3, "disjoint", torch.float32),  # N < P for P = 4
    (5000, "identical", torch.bfloat16),
    (5000, "skewed", torch.float16),
    (200, "empty", torch.float32),
    (1000, "dense", torch.float32),
    (70_001, "random", torch.float32),  # 4-byte indices
]


def reduce_every_algorithm(comm):  # type: ignore[no-untyped-def]
    """Every case with every algorithm; inputs and results as wire bytes."""
    out = []
    for size, pattern, dtype in CASES:
        s = make_stream(pattern, comm.rank, comm.world_size, size, dtype)
        for algo in [*algorithms(), "auto"]:
            comm.stats.reset()
            r = sparse_allreduce(s, comm, algorithm=algo)
            out.append((size, pattern, algo, encode(s), encode(r), comm.stats.bytes_sent))
    return out


def outstanding_async(comm):  # type: ignore[no-untyped-def]
    inputs = [make_stream("overlap", comm.rank, comm.world_size, 400, seed=i) for i in range(4)]
    works = [sparse_allreduce(s, comm, async_op=True) for s in inputs]
    results = [w.wait(timeout=60) for w in works]
    return [encode(s) for s in inputs], [encode(r) for r in results]


def mismatched_size(comm):  # type: ignore[no-untyped-def]
    try:
        sparse_allreduce(SparseStream.empty(50 if comm.rank != 2 else 49), comm)
    except RankMismatchError as e:
        return str(e)
    return "no error"


def dead_rank(comm, victim):  # type: ignore[no-untyped-def]
    if comm.rank == victim:
        os._exit(3)
    try:
        sparse_allreduce(SparseStream.empty(10), comm)
    except CommError as e:
        return type(e).__name__, e.peer, str(e)
    return "no error"


def absent_rank(comm, absent, seconds):  # type: ignore[no-untyped-def]
    if comm.rank == absent:
        time.sleep(seconds)
        return None
    t0 = time.monotonic()
    try:
        sparse_allreduce(SparseStream.empty(10), comm)
    except CommError as e:
        return type(e).__name__, e.peer, time.monotonic() - t0
    return "no error"
