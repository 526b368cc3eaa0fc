"""Rank functions of the CUDA tests (module level: spawned processes import them).

Every function takes the device its tensors live on (``"cuda"`` on a GPU machine;
``tests/test_cuda.py`` runs them on ``"cpu"`` when ``SPARCML_TEST_DEVICE=cpu`` to
check the tests themselves on a machine without one).
"""

from __future__ import annotations

import faulthandler
import os
from typing import Any

import torch

import sparcml.torch as st
from gloo_workers import CASES
from inputs import make_stream
from sparcml import OkTopkState, SparseStream, algorithms, oktopk_allreduce, sparse_allreduce
from sparcml.wire import encode
from train_workers import batch, flat_params, make_model

#: DDP methods run on the GPU: lossless ones must reproduce plain DDP
DDP_LOSSLESS = [("dense", {}), ("topk", {"density": 1.0}), ("nonzeros", {})]
DDP_LOSSY = [
    ("topk", {"density": 0.05}),
    ("natural", {}),
    ("qsgd", {}),
    ("fp16", {}),
    ("topk+natural", {"density": 0.05}),
    ("oktopk", {"density": 0.05}),
    ("redsync", {"density": 0.05}),
    ("threshold_bsearch", {"density": 0.05}),
]


def _watchdog() -> None:
    """A spawned rank stuck for ``SPARCML_TEST_DUMP_AFTER_S`` seconds prints every
    thread's stack and exits (to see where a hang is on a machine one cannot log in to)."""
    after = float(os.environ.get("SPARCML_TEST_DUMP_AFTER_S", "0"))
    if after > 0:
        faulthandler.dump_traceback_later(after, exit=True)


def _train(model: torch.nn.Module, rank: int, device: str, steps: int) -> torch.Tensor:
    """``steps`` of SGD (lr 0.1) on this rank's batches, moved to ``device``; the last loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(steps):
        x, y = batch(rank, t)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def every_algorithm(comm: Any, device: str) -> list[tuple[Any, ...]]:
    """Every exact algorithm and ``auto`` on every gloo test case, tensors on ``device``;
    the results as (case, algorithm, input bytes, result bytes, result device)."""
    _watchdog()
    out = []
    for size, pattern, dtype in CASES:
        s = make_stream(pattern, comm.rank, comm.world_size, size, dtype).to(device)
        for algo in [*algorithms(exact=True, variants=False), "auto"]:
            r = sparse_allreduce(s, comm, algorithm=algo)
            out.append(
                (size, pattern, algo, encode(s.to("cpu")), encode(r.to("cpu")), str(r.device))
            )
    return out


def topk_family(comm: Any, device: str) -> dict[str, Any]:
    """gTopk, TopkA, Gaussiank and Ok-Topk on ``device``: accumulators and results."""
    g = torch.Generator().manual_seed(1000 + comm.rank)
    acc = torch.randn(3000, generator=g).to(device)
    top = torch.topk(acc.abs(), 40).indices.sort().values
    local = SparseStream(top, acc[top], acc.numel())
    ok = oktopk_allreduce(acc, 40, comm, OkTopkState(tau=1, tau_prime=1))
    out: dict[str, Any] = {"acc": acc.cpu(), "oktopk": ok.stream}
    out["gtopk"] = sparse_allreduce(local, comm, algorithm="gtopk")
    out["topka"] = sparse_allreduce(local, comm, algorithm="topka")
    out["gaussiank"] = sparse_allreduce(SparseStream.dense(acc), comm, algorithm="gaussiank", k=40)
    out["devices"] = {k: str(v.device) for k, v in out.items() if isinstance(v, SparseStream)}
    return {k: v.to("cpu") if isinstance(v, SparseStream) else v for k, v in out.items()}


def ddp_methods(comm: Any, device: str, steps: int) -> dict[str, Any]:
    """Plain DDP and every DDP method on a model on ``device``: flat parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _watchdog()
    out: dict[str, Any] = {}
    for label, method, hyper in [
        ("plain", None, {}),
        *[(f"{m} {h}", m, h) for m, h in DDP_LOSSLESS + DDP_LOSSY],
    ]:
        model = DDP(make_model().to(device), bucket_cap_mb=0.004)
        state = st.register(model, method, **hyper) if method is not None else None
        loss = _train(model, comm.rank, device, steps)
        params = flat_params(model.module)
        out[label] = {
            "params": params.cpu(),
            "device": str(params.device),
            "loss": float(loss.detach()),
            "bytes": sum(state.step_bytes) if state is not None else 0,
        }
        del model, state
    return out


def fsdp_methods(comm: Any, device: str, steps: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on every layer) with plain and sparcml reduce-scatters."""
    from torch.distributed.fsdp import fully_shard

    _watchdog()
    out: dict[str, Any] = {}
    for label, method, hyper in [
        ("plain", None, {}),
        ("topk 1.0", "topk", {"density": 1.0}),
        ("topk 0.05", "topk", {"density": 0.05}),
        ("natural", "natural", {}),
    ]:
        model = make_model().to(device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        if method is not None:
            st.register_fsdp(model, method, **hyper)
        _train(model, comm.rank, device, steps)
        params = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
        out[label] = {"params": params.cpu(), "device": str(params.device)}
    return out
