"""Run under ``mpirun -n P``: the collectives, errors and a training run on MPI.

Usage: mpirun -n P python tests/mpi_workers.py OUTDIR [timeout-check]
Each rank writes OUTDIR/rank{r}.pt with what it checked; the test reads them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import sparcml
from inputs import PATTERNS, dense_reference, make_stream
from sparcml.comm import MPICommunicator, Topology
from sparcml.errors import CommError, CommTimeoutError, RankMismatchError
from sparcml.wire import encode
from train_workers import sync_train


def collectives(comm: MPICommunicator) -> dict:
    p = comm.world_size
    bad = []
    results = []
    for size, dtype in [(97, torch.float32), (5, torch.float64), (70_001, torch.float32)]:
        for pattern in PATTERNS:
            streams = [make_stream(pattern, r, p, size, dtype) for r in range(p)]
            ref = dense_reference(streams)
            for algo in [*sparcml.algorithms(exact=True, variants=False), "auto"]:
                out = sparcml.sparse_allreduce(streams[comm.rank], comm, algorithm=algo)
                if not torch.equal(out.to_dense().double(), ref):
                    bad.append((size, pattern, algo))
                results.append(encode(out))
    works = [
        sparcml.sparse_allreduce(
            make_stream("overlap", comm.rank, p, 400, seed=i), comm, async_op=True
        )
        for i in range(3)
    ]
    for i, w in enumerate(works):
        ref = dense_reference([make_stream("overlap", r, p, 400, seed=i) for r in range(p)])
        if not torch.equal(w.wait(timeout=60).to_dense().double(), ref):
            bad.append(("async", i))
    try:
        sparcml.sparse_allreduce(sparcml.SparseStream.empty(50 if comm.rank != 1 else 49), comm)
        mismatch = None
    except RankMismatchError as e:
        mismatch = str(e)
    if p % 2 == 0:
        # the two-level algorithms on 2-rank nodes: groups over MPI's point to point
        # (a communicator of their own, so the training below runs flat as over gloo)
        nodes = MPICommunicator(timeout=60)
        nodes.set_topology(Topology.regular(p, 2))
        for size in (97, 70_001):
            for pattern in PATTERNS:
                streams = [make_stream(pattern, r, p, size) for r in range(p)]
                ref = dense_reference(streams)
                for algo in ("twolevel_shard", "twolevel_leader"):
                    out = sparcml.sparse_allreduce(streams[comm.rank], nodes, algorithm=algo)
                    if not torch.equal(out.to_dense().double(), ref):
                        bad.append((size, pattern, algo, "2-rank nodes"))
                    results.append(encode(out))
        nodes.close()
    dense = comm.allreduce(torch.arange(6, dtype=torch.float32) * (comm.rank + 1))
    gathered = comm.allgather(torch.tensor([comm.rank, 7]))
    return {
        "bad": bad,
        "results": results,
        "mismatch": mismatch,
        "dense": dense,
        "gathered": gathered,
        "bytes_sent": comm.stats.bytes_sent,
    }


def training(comm: MPICommunicator) -> dict:
    return {
        method: sync_train(comm, method, hyper, 5)
        for method, hyper in [
            ("topk", {"density": 0.05, "algorithm": "ssar_split_allgather"}),
            ("dense", {}),
            ("oktopk", {"density": 0.05}),
        ]
    }


def timeout_check(comm: MPICommunicator) -> str:
    """Rank 1 arrives late: every other rank must time out naming it."""
    comm.timeout = 1.0
    if comm.rank == 1:
        time.sleep(3.0)
    try:
        sparcml.sparse_allreduce(sparcml.SparseStream.empty(10), comm)
    except CommTimeoutError as e:
        return f"peer={e.peer}: {e}"
    return "no error"


def dense_timeout_check(comm: MPICommunicator) -> str:
    """A large dense allreduce (MPI's blocking collective on the helper thread): rank 1
    arrives late, the others time out instead of hanging, and refuse the next call."""
    comm.timeout = 1.0
    x = torch.ones(1 << 20)  # 4 MB: past BLOCKING_MIN_BYTES
    if comm.rank == 1:
        time.sleep(3.0)
        return "late: " + str(float(comm.allreduce(x)[0]))
    try:
        comm.allreduce(x)
    except CommTimeoutError as e:
        first = f"{type(e).__name__}: {e}"
    else:
        return "no error"
    try:
        comm.allreduce(x)
    except CommError as e:
        return f"{first} | then {type(e).__name__}: {e}"
    return f"{first} | then no error"


def main() -> None:
    out = Path(sys.argv[1])
    comm = MPICommunicator(timeout=60)
    if len(sys.argv) > 2 and sys.argv[2] == "timeout-check":
        result = {"timeout": timeout_check(comm)}
        comm.mpi.Barrier()
        result["dense"] = dense_timeout_check(comm)
    else:
        result = {"collectives": collectives(comm), "training": training(comm)}
    torch.save(result, out / f"rank{comm.rank}.pt")
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
