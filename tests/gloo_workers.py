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
        for algo in [*algorithms(exact=True, variants=False), "auto"]:
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
    # every rank past its connection set-up first: a victim that exits while a peer
    # is still inside init_process_group fails that peer's init, not the collective
    comm.barrier()
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


def groups_and_default(comm):  # type: ignore[no-untyped-def]
    """A sub-group of ranks 1..P-1, a dedicated group, and the default communicator."""
    import torch.distributed as dist

    from sparcml.comm import TorchDistCommunicator

    world = comm.world_size
    members = list(range(1, world))
    sub = dist.new_group(ranks=members)  # every rank takes part in creating it
    own = TorchDistCommunicator.dedicated(timeout=30)
    s = make_stream("overlap", comm.rank, world, 301)
    out = {"input": encode(s)}
    out["default"] = encode(sparse_allreduce(s, algorithm="ssar_split_allgather"))
    out["dedicated"] = encode(sparse_allreduce(s, own, algorithm="ssar_recursive_double"))
    if comm.rank in members:
        sc = TorchDistCommunicator(group=sub, timeout=30)
        assert sc.rank == comm.rank - 1 and sc.world_size == world - 1
        out["sub"] = encode(sparse_allreduce(s, sc, algorithm="ssar_recursive_double"))
    own.close()
    return out


def topk_family(comm):  # type: ignore[no-untyped-def]
    """Ok-Topk (tau = tau' = 1), gTopk and TopkA over gloo; inputs and results as bytes."""
    from sparcml import OkTopkState, oktopk_allreduce

    g = torch.Generator().manual_seed(1000 + comm.rank)
    acc = torch.randn(3000, generator=g)
    ok = oktopk_allreduce(acc, 40, comm, OkTopkState(tau=1, tau_prime=1))
    top = torch.topk(acc.abs(), 40).indices
    local = SparseStream(top, acc[top], acc.numel())
    return {
        "acc": acc,
        "oktopk": encode(ok.stream),
        "local_indices": ok.local_indices,
        "gtopk": encode(sparse_allreduce(local, comm, algorithm="gtopk")),
        "topka": encode(sparse_allreduce(local, comm, algorithm="topka")),
    }


def raises_on_rank_one(comm):  # type: ignore[no-untyped-def]
    if comm.rank == 1:
        raise KeyError("deliberate failure on rank 1")
    return comm.rank


def message_sizes(comm):  # type: ignore[no-untyped-def]
    """Point-to-point messages around the eager protocol's boundary, and an alltoallv
    of mixed sizes: what each rank received, with what it should have been."""
    EAGER_BYTES = comm.eager_bytes  # the first message's size in this group

    p, me = comm.world_size, comm.rank
    sizes = [
        0,
        1,
        24,
        EAGER_BYTES - 9,
        EAGER_BYTES - 8,
        EAGER_BYTES - 7,
        EAGER_BYTES,
        3 * EAGER_BYTES + 5,
    ]

    def payload(src: int, dst: int, n: int) -> torch.Tensor:
        return ((torch.arange(n, dtype=torch.int64) * (src + 3) + dst * 7 + n) % 251).to(
            torch.uint8
        )

    bad = []
    right, left = (me + 1) % p, (me - 1) % p
    for n in sizes:  # every size in turn around the ring, the same tag
        h = comm.isend(payload(me, right, n), right)
        got = comm.recv(left)
        h.wait()
        if not torch.equal(got, payload(left, me, n)):
            bad.append(("ring", n, got.numel()))
    # all sizes at once to every peer: in-order matching on one tag
    handles = [comm.isend(payload(me, d, n), d) for d in range(p) if d != me for n in sizes]
    for s in range(p):
        if s != me:
            for n in sizes:
                got = comm.recv(s)
                if not torch.equal(got, payload(s, me, n)):
                    bad.append(("burst", s, n, got.numel()))
    for h in handles:
        h.wait()
    parts = [payload(me, d, sizes[(me + d) % len(sizes)]) for d in range(p)]
    for s, got in enumerate(comm.alltoallv(parts)):
        if not torch.equal(got, payload(s, me, sizes[(s + me) % len(sizes)])):
            bad.append(("alltoallv", s, got.numel()))
    return bad


def allgather_sizes(comm):  # type: ignore[no-untyped-def]
    """``comm.allgather`` on both sides of the direct (all-to-all) threshold, every
    dtype, shapes and strides, and on a sub-group: what went wrong, and the bytes
    counted for one piece of each way."""
    import torch.distributed as dist

    from sparcml.comm import TorchDistCommunicator
    from sparcml.comm.torchdist import DIRECT_ALLGATHER_BYTES

    def piece(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = (torch.arange(n, dtype=torch.int64) * (r + 3) + n) % 97
        return (t % 2).bool() if dtype == torch.bool else t.to(dtype)

    direct = []  # which calls took the all-to-all
    a2a = dist.all_to_all_single

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        direct.append(args[0].numel() // comm.world_size)
        return a2a(*args, **kwargs)

    dist.all_to_all_single = counting  # this child process only
    bad = []
    counts = {}
    cases = [
        (n, torch.uint8) for n in (0, 1, 7, DIRECT_ALLGATHER_BYTES, DIRECT_ALLGATHER_BYTES + 1)
    ]
    cases += [
        (5, d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool)
    ]
    cases += [(DIRECT_ALLGATHER_BYTES // 8 + 1, torch.float64)]
    for n, dtype in cases:
        comm.stats.reset()
        got = comm.allgather(piece(comm.rank, n, dtype))
        counts[(n, str(dtype))] = (comm.stats.bytes_sent, len(direct))
        for r, g in enumerate(got):
            if g.dtype != dtype or not torch.equal(g, piece(r, n, dtype)):
                bad.append(("flat", n, str(dtype), r))
    # a 2-D strided input keeps its shape; a one-element view with an odd stride
    m = torch.arange(60, dtype=torch.float32).view(6, 10) * (comm.rank + 1)
    for r, g in enumerate(comm.allgather(m[:, ::3])):
        if g.shape != (6, 4) or not torch.equal(
            g, (torch.arange(60.0).view(6, 10) * (r + 1))[:, ::3]
        ):
            bad.append(("strided", r))
    one = (torch.arange(10.0) + comm.rank)[3::5][:1]
    if [float(g) for g in comm.allgather(one)] != [3.0 + r for r in range(comm.world_size)]:
        bad.append(("one-element",))
    members = list(range(1, comm.world_size))
    sub = dist.new_group(ranks=members)
    if comm.rank in members:
        sc = TorchDistCommunicator(group=sub, timeout=30)
        got = sc.allgather(torch.tensor([comm.rank], dtype=torch.int64))
        if [int(g) for g in got] != members:
            bad.append(("subgroup", [int(g) for g in got]))
        sc.close()
    dist.all_to_all_single = a2a
    return bad, counts


def dead_rank_in_allgather(comm, victim):  # type: ignore[no-untyped-def]
    # every rank past its connection set-up first: a victim that exits while a peer
    # is still inside init_process_group fails that peer's init, not the collective
    comm.barrier()
    if comm.rank == victim:
        os._exit(3)
    try:
        comm.allgather(torch.tensor([comm.rank], dtype=torch.int64))
    except CommError as e:
        return type(e).__name__, e.peer, str(e)
    return "no error"


def rank_and_size(comm):  # type: ignore[no-untyped-def]
    return comm.rank, comm.world_size


def environment_and_modules(comm, names):  # type: ignore[no-untyped-def]
    """What a rank sees at its start: these environment variables, and which of the
    launcher's preloaded modules were there before the rank imported anything."""
    import os
    import sys

    from sparcml.comm.launch import PRELOAD

    return {
        "env": {n: os.environ.get(n) for n in names},
        "preloaded": [m for m in PRELOAD if m in sys.modules],
    }


def donated_allreduce(comm):  # type: ignore[no-untyped-def]
    """``allreduce(donate=True)`` reduces into the tensor itself; without it, and for a
    dense stream through ``algorithm="dense"``, the caller's tensor is never written."""
    x = torch.arange(6, dtype=torch.float32) + comm.rank
    kept = x.clone()
    plain = comm.allreduce(x)
    donated = comm.allreduce(x, donate=True)
    dense = SparseStream.dense(kept.clone())
    before = dense.to_dense().clone()
    total = sparse_allreduce(dense, comm, algorithm="dense").to_dense()
    sparse = sparse_allreduce(SparseStream.from_dense(kept), comm, algorithm="dense")
    return {
        "same_storage": donated.data_ptr() == x.data_ptr(),
        "plain": plain,
        "donated": donated,
        "dense_untouched": torch.equal(dense.to_dense(), before),
        "total": total,
        "sparse": sparse.to_dense(),
    }


def two_level(comm):  # type: ignore[no-untyped-def]
    """2 nodes of P/2 ranks, found from torchrun's GROUP_RANK (one 8-byte allgather);
    every case with both two-level algorithms and auto."""
    half = comm.world_size // 2  # as torchrun sets them on 2 nodes
    os.environ.update(GROUP_RANK=str(comm.rank // half), LOCAL_WORLD_SIZE=str(half))
    topo = comm.topology
    out = []
    for size, pattern, dtype in CASES:
        s = make_stream(pattern, comm.rank, comm.world_size, size, dtype)
        for algo in ("twolevel_shard", "twolevel_leader", "auto"):
            r = sparse_allreduce(s, comm, algorithm=algo)
            out.append((size, pattern, algo, encode(s), encode(r)))
    return str(topo), topo.node_ranks(comm.rank), out


def two_level_ddp(comm, steps):  # type: ignore[no-untyped-def]
    """The DDP hook reducing with the shard-parallel two-level algorithm on 2 nodes."""
    from train_workers import ddp_train

    os.environ.update(GROUP_RANK=str(comm.rank // 2), LOCAL_WORLD_SIZE="2")
    hyper = {"density": 1.0, "algorithm": "twolevel_shard"}
    return ddp_train(comm, "topk", hyper, steps, False)


def two_level_fsdp(comm, steps):  # type: ignore[no-untyped-def]
    """FSDP2 with sparcml's reduce-scatter on 2 nodes (two levels) and plain FSDP."""
    from fsdp_workers import fsdp_runs

    os.environ.update(GROUP_RANK=str(comm.rank // 2), LOCAL_WORLD_SIZE="2")
    runs = [("plain", None, {}), ("nonzeros", "nonzeros", {}), ("topk1", "topk", {"density": 1.0}),
            ("natural", "natural", {})]  # fmt: skip
    out = fsdp_runs(comm, runs, steps)
    from sparcml.comm import resolve

    out["topology"] = str(resolve(None).topology)
    return out


def absurd_length_word(comm: object) -> str:
    """Rank 1 sends a bare 8-byte length word of 2^62 bytes on tag 0 (a message of the
    user's own on the group): what rank 0's sparcml receive raises."""
    import torch.distributed as dist

    if comm.rank == 1:
        dist.send(torch.tensor([1 << 62], dtype=torch.int64).view(torch.uint8), dst=0, tag=0)
        return "sent"
    try:
        comm.recv(1)
    except Exception as e:  # (its type is what the test checks)
        return f"{type(e).__name__}: {e}"
    return "no error"


def exchange_order(comm):  # type: ignore[no-untyped-def]
    """The order in which an exchange posts its gloo operations (``sendrecv``,
    ``alltoallv``, ring ``allgatherv`` at P = 2): ("send"|"recv", bytes) each."""
    import torch.distributed as dist

    from sparcml.comm import torchdist

    log: list[tuple[str, int]] = []

    class Recording:
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(dist, name)

        def isend(self, t, *a, **k):  # type: ignore[no-untyped-def]
            log.append(("send", t.numel()))
            return dist.isend(t, *a, **k)

        def irecv(self, t, *a, **k):  # type: ignore[no-untyped-def]
            log.append(("recv", t.numel()))
            return dist.irecv(t, *a, **k)

    big = torch.full((2 * comm.eager_bytes,), comm.rank, dtype=torch.uint8)
    peer = 1 - comm.rank
    torchdist.dist = Recording()  # type: ignore[assignment]
    try:
        out = {}
        for name, call in [
            ("sendrecv", lambda: [comm.sendrecv(big, peer)]),
            ("alltoallv", lambda: comm.alltoallv([big, big])),
            ("allgatherv", lambda: comm.allgatherv(big)),
        ]:
            log.clear()
            got = call()
            assert all(bool((g == g[0]).all()) for g in got)
            out[name] = list(log)
        return out
    finally:
        torchdist.dist = dist


def large_messages(comm, algos, per_node):  # type: ignore[no-untyped-def]
    """Every algorithm of ``algos`` on 100,000 entries a rank (messages of about
    800 KB: a head and a body over gloo), nodes of ``per_node`` ranks (0: flat)."""
    if per_node:
        os.environ.update(GROUP_RANK=str(comm.rank // per_node), LOCAL_WORLD_SIZE=str(per_node))
    n, k = 1 << 20, 100_000
    g = torch.Generator().manual_seed(comm.rank)
    s = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
    return [(algo, encode(s), encode(sparse_allreduce(s, comm, algorithm=algo))) for algo in algos]


def held_body_then_abort(comm):  # type: ignore[no-untyped-def]
    """Rank 0 holds a body for an exchange (its receive never gets a body) and then
    fails: its abort note must reach rank 1 after that body, not in its place."""
    import torch.distributed as dist

    big = torch.full((1 << 20,), 7, dtype=torch.uint8)
    if comm.rank == 0:
        recv = comm.irecv(1)  # rank 1 sends nothing before the end: no body here
        comm.isend(big, 1, after=recv)  # the body is held
        comm.fail_call(RuntimeError("deliberate failure"))
        time.sleep(3)  # (the connection stays while rank 1 reads)
        return None
    got = comm.recv(0)
    whole = got.numel() == big.numel() and bool((got == 7).all())
    try:
        comm.recv(0)
        outcome = ("no error", "")
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    dist.send(torch.zeros(8, dtype=torch.uint8), 0)  # (ends rank 0's receive)
    return whole, *outcome
