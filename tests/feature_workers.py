"""Rank functions of the DDP-feature matrix tests (module level: spawned processes
import them). Every feature runs with each method in one process pair."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import sparcml.torch as st
from train_workers import batch, make_model

FEATURES = (
    "no_sync",
    "find_unused_parameters",
    "frozen",
    "static_graph",
    "bf16",
    "fp16",
    "join",
    "gradient_as_bucket_view",
    "compile",
)


class Branchy(torch.nn.Module):
    """The test model plus a branch no step uses (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.unused = torch.nn.Linear(20, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _run(comm: Any, feature: str, method: str, hyper: dict[str, Any], steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # several small buckets; under torch.compile DDP's own bucketing (its DDPOptimizer
    # asserts that the first bucket is not larger than the others)
    kw: dict[str, Any] = {} if feature == "compile" else {"bucket_cap_mb": 0.004}
    model: torch.nn.Module = make_model()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(feature, torch.float32)
    if feature == "find_unused_parameters":
        model, kw["find_unused_parameters"] = Branchy(), True
    elif feature == "frozen":
        for p in model[0].parameters():
            p.requires_grad_(False)
    elif feature == "static_graph":
        kw["static_graph"] = True
    elif feature == "gradient_as_bucket_view":
        kw["gradient_as_bucket_view"] = True
    model = model.to(dtype)
    ddp = DDP(model, **kw)
    state = st.register(ddp, method, **hyper)
    run: Any = torch.compile(ddp, backend="aot_eager") if feature == "compile" else ddp
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    # uneven inputs: rank 1 has two more batches than rank 0
    n = steps + (2 * comm.rank if feature == "join" else 0)
    losses = []
    with ddp.join() if feature == "join" else contextlib.nullcontext():
        for t in range(n):
            x, y = batch(comm.rank, t)
            x = x.to(dtype)
            opt.zero_grad()
            if feature == "no_sync":  # accumulate one micro-batch locally, sync the second
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(run(x[:16]).float(), y[:16]).backward()
                x, y = x[16:], y[16:]
            loss = torch.nn.functional.cross_entropy(run(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    params = torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()])
    return {"params": params, "losses": losses, "step": state.step}


def feature_matrix(
    comm: Any, features: list[str], methods: list[tuple[str, dict[str, Any]]], steps: int
) -> dict[str, dict[str, Any]]:
    """``{"feature/method": result or {"error": "Type: message"}}``."""
    out: dict[str, dict[str, Any]] = {}
    for feature in features:
        for method, hyper in methods:
            key = f"{feature}/{method}"
            try:
                out[key] = _run(comm, feature, method, hyper, steps)
            except Exception as e:  # recorded: the matrix says which error
                out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out
