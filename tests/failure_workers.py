"""Rank functions for the failure-semantics tests (module level: spawned processes import them)."""

from __future__ import annotations

import time
from typing import Any

import torch

import sparcml.torch as st
from sparcml import SparseStream, sparse_allreduce
from sparcml.errors import CommError, SparcmlError
from sparcml.tools.bench import faults as _bench_faults


def _caught(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "peer": getattr(e, "peer", None), "message": str(e)}


def ddp_nan(comm: Any, method: str, policy: str) -> dict[str, Any]:
    """DDP with a NaN gradient on rank 1 at step 1; the error's type through the hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(6, 3), bucket_cap_mb=0.0001)
    state = st.register(model, method, nan_policy=policy, density=0.5)
    out: dict[str, Any] = {"steps": 0}
    for t in range(3):
        x = torch.ones(4, 6)
        if comm.rank == 1 and t == 1:
            x[0, 0] = float("nan")
        try:
            model(x).sum().backward()
            out["steps"] += 1
            out.setdefault("grads", []).append(model.module.weight.grad.clone())
        except Exception as e:
            out.setdefault("errors", []).append(_caught(e))
        model.zero_grad()
    out["state_step"] = state.step
    return out


def register_mismatch(comm: Any, hyper_by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    hyper = dict(hyper_by_rank[comm.rank])
    method = hyper.pop("method")
    t0 = time.monotonic()
    try:
        st.register(model, method, **hyper)
    except SparcmlError as e:
        return {**_caught(e), "seconds": time.monotonic() - t0}
    return {"type": "no error"}


def refused_on_one_rank(comm: Any, api: str, bad: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 builds its state with ``bad`` arguments (the others valid), through
    ``register``, PyTorch's ``(state, hook)`` pair (built at the first bucket) or
    ``SparcmlState.from_config`` (a ``method`` that is a config path: a file missing on
    rank 1); what each rank raised and how long it took. The refusing rank stays
    alive a moment."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    hyper = {"method": "topk", "density": 0.1, **(bad if comm.rank == 1 else {})}
    method = hyper.pop("method")
    t0 = time.monotonic()
    try:
        if api == "register":
            st.register(model, method, timeout=20, **hyper)
        elif api == "from_config":
            config = method if method.endswith(".yaml") else {"method": method}
            st.SparcmlState.from_config(config, timeout=20, **hyper)
        else:
            state, hook = st.comm_hook(method, timeout=20, **hyper)
            model.register_comm_hook(state, hook)
            model(torch.ones(3, 4)).sum().backward()
        out = {"type": "no error"}
    except Exception as e:
        out = _caught(e)
    out["seconds"] = time.monotonic() - t0
    # every rank alive a while: rank 1 so that the others must not wait for it to
    # die; the others so that rank 0's rendezvous store outlives a slower rank's
    # check-in (under torchrun the agent holds it)
    time.sleep(2)
    return out


def absent_from_construction(comm: Any, absent: int) -> dict[str, Any]:
    """Every rank builds a SparcmlState (timeout 2 s), ``absent`` only after 4 s."""
    if comm.rank == absent:
        time.sleep(4)
    t0 = time.monotonic()
    try:
        st.SparcmlState("topk", density=0.1, timeout=2.0)
        out: dict[str, Any] = {"type": "no error"}
    except Exception as e:
        out = _caught(e)
    out["seconds"] = time.monotonic() - t0
    if comm.rank != absent:
        time.sleep(4)  # (alive, with the store rank 0 hosts, while the late rank arrives)
    return out


def dense_timeout(comm: Any, absent: int, algorithm: str) -> dict[str, Any] | None:
    """``absent`` never calls; the others run a dense collective and give up."""
    if comm.rank == absent:
        # alive but silent until the others are done (run_processes stops it then): on a
        # loaded machine the survivors' timeout and agreement take several timeouts
        time.sleep(comm.timeout * 30)
        return None
    try:
        if algorithm == "ddp-dense":
            state = st.SparcmlState("dense", comm=comm)
            opt = st.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))]),
                                          [torch.nn.Parameter(torch.ones(3))], state)  # fmt: skip
            opt.step()
        else:
            sparse_allreduce(SparseStream.dense(torch.ones(64)), comm, algorithm=algorithm)
    except CommError as e:
        return _caught(e)
    return {"type": "no error"}


def skip_a_step(comm: Any, use_call_id: bool) -> list[Any]:
    """P = 3: rank 1 skips step 1 and makes an extra call at the end."""
    out: list[Any] = []
    steps = [0, 2, 3] if comm.rank == 1 else [0, 1, 2]
    for t in steps:
        s = SparseStream.dense(torch.full((4,), float(t)))
        try:
            r = sparse_allreduce(
                s, comm, algorithm="ssar_split_allgather", call_id=t if use_call_id else None
            )
            out.append(r.to_dense().tolist())
        except SparcmlError as e:
            out.append(_caught(e))
            break
    return out


def quantizer_nan(comm: Any) -> dict[str, Any]:
    g = torch.ones(32)
    if comm.rank == 2:
        g[5] = float("inf")
    t0 = time.monotonic()
    try:
        sparse_allreduce(SparseStream.dense(g), comm, algorithm="dsar_split_allgather",
                         quantizer="qsgd", quantize="all")  # fmt: skip
    except Exception as e:
        return {**_caught(e), "seconds": time.monotonic() - t0}
    return {"type": "no error"}


def raises_inside_collective(comm: Any, victim: int) -> dict[str, Any] | None:
    """The victim's own code raises inside a collective (a broken quantizer), then exits."""
    from sparcml.compress import get

    q = get("qsgd")
    if comm.rank == victim:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise KeyError("corrupt quantizer table")

        q.quantize = broken  # type: ignore[method-assign]
    x = SparseStream.dense(torch.ones(64))
    try:
        sparse_allreduce(x, comm, algorithm="dsar_split_allgather", quantizer=q, quantize="all")
    except CommError as e:
        return _caught(e)
    except KeyError:
        import os

        os._exit(4)  # the victim dies after its error, like an uncaught exception would
    return {"type": "no error"}


def every_rank_raises(comm: Any) -> dict[str, Any]:
    """Every rank's own code raises inside the same collective at once (a step that
    fails alike on every rank without knowing it, as a CUDA-only bug does): each
    sends the others an abort note that none of them posts a receive for."""
    from sparcml.compress import get

    q = get("qsgd")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError(f"corrupt quantizer table on rank {comm.rank}")

    q.quantize = broken  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        sparse_allreduce(
            SparseStream.dense(torch.ones(64)), comm, algorithm="dsar_split_allgather",
            quantizer=q, quantize="all",
        )  # fmt: skip
    except Exception as e:
        return {**_caught(e), "seconds": time.monotonic() - t0}
    return {"type": "no error"}


# the mismatch matrix lives with the benchmark that measures it (one place)
MISMATCHES = _bench_faults.MISMATCHES
MISMATCH_NAMES = _bench_faults.MISMATCH_NAMES
mismatch = _bench_faults.mismatch_worker


def mismatch_seen_by_one_rank(comm: Any) -> dict[str, Any] | None:
    """Rank 0 waits in gloo's own allreduce (no abort note reaches it), rank 1
    receives from rank 2, rank 2 sends, then raises a mismatch only it saw."""
    from sparcml.comm.abort import mark_uniform
    from sparcml.errors import RankMismatchError

    number = comm.next_sequence()
    out = None
    try:
        with comm.in_call(number):
            if comm.rank == 0:
                comm.allreduce(torch.ones(4))
            elif comm.rank == 1:
                comm.recv(2)
                comm.recv(2)  # takes rank 2's note
            else:
                comm.send(torch.zeros(0, dtype=torch.uint8), 1)
                raise mark_uniform(RankMismatchError("only rank 2 sees this"), False)
    except Exception as e:
        out = _caught(e)
    if comm.rank != 0:
        time.sleep(comm.timeout + 3)  # alive: no closed connection to go by
    return out


def alike_error_then_calls(comm: Any, algorithm: str, calls: int, exits: int | None) -> Any:
    """Every rank passes a tensor where a stream belongs (the documented TypeError,
    raised by each), then makes ``calls`` calls 0.1 s apart; rank ``exits`` leaves at
    the third. Returns the first error and what the later calls did. (The number of
    calls is fixed: a loop that ran for some seconds on each rank's own clock left a
    rank waiting in one more call that the others, out of time, never made.)"""
    import os

    out: dict[str, Any] = {}
    try:
        sparse_allreduce(torch.zeros(8), comm)  # type: ignore[arg-type]
    except Exception as e:
        out["first"] = type(e).__name__
    for done in range(calls):
        if done == 2 and comm.rank == exits:
            os._exit(3)
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        try:
            got = sparse_allreduce(s, comm, algorithm=algorithm)
        except Exception as e:
            return {**out, "calls": done, "error": _caught(e)}
        assert got.to_dense().tolist() == [1.0] * comm.world_size + [0.0] * (8 - comm.world_size)
        time.sleep(0.1)
    return {**out, "calls": calls, "error": None}


def bad_input_on_rank_0(comm: Any, api: str, algorithm: str, hold: float) -> dict[str, Any]:
    """Rank 0 passes a plain tensor where a SparseStream is due; every rank's error and
    how long it took (the others must hear of it at once, not at their timeout)."""
    from sparcml import sparse_allgather

    good = SparseStream(torch.tensor([comm.rank]), torch.ones(1), 16)
    arg: Any = torch.ones(16) if comm.rank == 0 else good
    t0 = time.monotonic()
    try:
        if api == "sparse_allgather":
            sparse_allgather(arg, comm)
        else:
            sparse_allreduce(arg, comm, algorithm)
    except (SparcmlError, TypeError) as e:
        out = {**_caught(e), "seconds": time.monotonic() - t0}
        if comm.rank == 0:
            time.sleep(hold)  # alive: the others must not learn of it from its exit
        return out
    return {"type": "no error", "seconds": time.monotonic() - t0}


def gtopk_parent_fails_first(comm: Any, victim: int, hold: float) -> dict[str, Any]:
    """gTop-k at P = 4 where rank ``victim`` (rank 3's parent in the tree) fails in its
    own selection, before it receives anything: every rank's error and its time."""
    import sparcml.collectives.gtopk as gtopk

    if comm.rank == victim:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise KeyError("corrupt selection table")

        gtopk.keep_topk = broken  # type: ignore[attr-defined]
    s = SparseStream(torch.arange(comm.rank, 64, 4), torch.ones(16), 64)
    t0 = time.monotonic()
    try:
        sparse_allreduce(s, comm, "gtopk", k=4)
    except (SparcmlError, KeyError) as e:
        out = {**_caught(e), "seconds": time.monotonic() - t0}
        if comm.rank == victim:
            time.sleep(hold)  # alive: the others must not learn of it from its exit
        return out
    return {"type": "no error", "seconds": time.monotonic() - t0}


def store_opened_ahead(comm: Any, victim: int) -> dict[str, Any]:
    """Whether the abort record's store connection is open before any failure, and
    the error each rank gets when rank ``victim`` then raises in an allreduce with
    new connections refused (a failure must not need one)."""
    import sparcml.collectives.gtopk as gtopk

    deadline = time.monotonic() + 10.0
    while comm.faults.store is None and time.monotonic() < deadline:
        time.sleep(0.01)
    opened = comm.faults.store is not None
    comm.barrier()  # (every rank past its wait before the call's own timeout starts)
    asked: list[bool] = []

    def refuse() -> Any:
        asked.append(True)
        raise ConnectionRefusedError("a failure opened a new store connection")

    comm.faults._connect = refuse
    if comm.rank == victim:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise KeyError("corrupt selection table")

        gtopk.keep_topk = broken  # type: ignore[attr-defined]
    s = SparseStream(torch.arange(comm.rank, 64, 4), torch.ones(16), 64)
    try:
        sparse_allreduce(s, comm, "gtopk", k=4)
    except (SparcmlError, KeyError) as e:
        if comm.rank == victim:
            time.sleep(3.0)  # alive: the others must not learn of it from its exit
        return {**_caught(e), "opened": opened, "reconnected": bool(asked)}
    return {"type": "no error", "opened": opened, "reconnected": bool(asked)}
