"""Rank functions for the failure-semantics tests (module level: spawned processes import them)."""

from __future__ import annotations

import time
from typing import Any

import torch

import sparcml.torch as st
from sparcml import SparseStream, sparse_allreduce
from sparcml.errors import CommError, SparcmlError


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


#: one setting passed differently on one rank (issue 34's mismatch matrix): the
#: keyword arguments of sparse_allreduce for (the odd rank, the others)
MISMATCHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "algorithm": ({"algorithm": "ssar_split_allgather"}, {"algorithm": "ssar_recursive_double"}),
    "algorithm (dense)": ({"algorithm": "dense"}, {"algorithm": "ssar_split_allgather"}),
    "algorithm (auto)": ({"algorithm": "ssar_split_allgather"}, {"algorithm": "auto"}),
    "quantizer": ({"algorithm": "dsar_split_allgather", "quantizer": "qsgd"},
                  {"algorithm": "dsar_split_allgather"}),
    "quantizer (dense)": ({"algorithm": "dense", "quantizer": "qsgd"}, {"algorithm": "dense"}),
    "quantize mode": ({"algorithm": "dsar_split_allgather", "quantizer": "qsgd", "quantize": "all"},
                      {"algorithm": "dsar_split_allgather", "quantizer": "qsgd"}),
    "index coding": ({"quantizer": "natural", "quantize": "all", "index_coding": "delta"},
                     {"quantizer": "natural", "quantize": "all"}),
    "k": ({"algorithm": "oktopk", "k": 5}, {"algorithm": "oktopk", "k": 4}),
    "dtype": ({"dtype": torch.float64}, {}),
    "N": ({"size": 49}, {}),
}  # fmt: skip
#: the words each refusal must carry
MISMATCH_NAMES = {
    "algorithm": "algorithm", "algorithm (dense)": "algorithm", "algorithm (auto)": "algorithm",
    "quantizer": "quantizer", "quantizer (dense)": "quantizer", "quantize mode": "quantize mode",
    "index coding": "index coding", "k": "k settings", "dtype": "dtypes", "N": "sizes",
}  # fmt: skip


def mismatch(comm: Any, case: str, odd: int) -> dict[str, Any]:
    """Every rank calls sparse_allreduce once, rank ``odd`` with one setting changed
    (``case`` of :data:`MISMATCHES`, or ``"raises"``: its quantizer raises KeyError)."""
    mine = MISMATCHES[case][0 if comm.rank == odd else 1] if case in MISMATCHES else {}
    kw = dict(mine)
    size, dtype = kw.pop("size", 50), kw.pop("dtype", torch.float32)
    g = torch.Generator().manual_seed(comm.rank)
    stream = SparseStream(torch.tensor([1, 3, 40]), torch.randn(3, generator=g).to(dtype), size)
    if kw.get("algorithm") == "oktopk":
        stream = SparseStream.dense(torch.randn(size, generator=g).to(dtype))
    if case == "raises":
        from sparcml.compress import get

        q = get("qsgd")
        if comm.rank == odd:

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise KeyError("corrupt quantizer table")

            q.quantize = broken  # type: ignore[method-assign]
        kw = {"algorithm": "ssar_split_allgather", "quantizer": q, "quantize": "all"}
    t0 = time.monotonic()
    try:
        sparse_allreduce(stream, comm, **kw)
    except Exception as e:
        return {**_caught(e), "seconds": time.monotonic() - t0}
    return {"type": "no error", "seconds": time.monotonic() - t0}
