"""Rank functions of the checkpoint/resume tests (module level: spawned processes
import them). One process pair trains every method in a loop, to keep it cheap."""

from __future__ import annotations

import os
from typing import Any

import torch

import sparcml.torch as st
from train_workers import batch, flat_params, make_model

# (label, method, hyperparameters): every kind of per-rank state the library keeps
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("dense", "dense", {}),
    ("topk", "topk", {"density": 0.05}),
    ("topk+natural", "topk+natural", {"density": 0.05}),
    ("topk-dgc", "topk", {"density": 0.05, "momentum": 0.9, "warmup_steps": 2}),
    ("randomk", "randomk", {"density": 0.05}),
    ("threshold_reuse", "threshold_reuse", {"density": 0.05,
                                            "compressor_params": {"interval": 3}}),
    ("oktopk", "oktopk", {"density": 0.05, "tau": 3, "tau_prime": 2}),
    ("redsync", "redsync", {"density": 0.05, "min_bytes": 1024,
                            "bsearch_numel": 1500}),
    ("redsync+asq", "redsync", {"density": 0.05, "min_bytes": 1024,
                                "bsearch_numel": 1500, "asq": True}),
    ("natural", "natural", {}),
    ("qsgd", "qsgd", {}),
    ("nonzeros", "nonzeros", {}),
]  # fmt: skip
MODES = ("ddp", "sync")


def _setup(mode: str, method: str, hyper: dict[str, Any], comm: Any) -> tuple[Any, Any, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    momentum = 0.0 if hyper.get("momentum") else 0.9  # DGC needs a plain SGD
    if mode == "ddp":
        model = DDP(model, bucket_cap_mb=0.004)  # several buckets
        state = st.register(model, method, **hyper)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        return model, state, opt
    state = st.SparcmlState(method, **hyper, bucket_bytes=4096)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return model, state, st.DistributedOptimizer(sgd, model, state)


def _steps(model: Any, opt: Any, rank: int, start: int, stop: int) -> None:
    for t in range(start, stop):
        x, y = batch(rank, t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _inner(model: Any) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def first_run(comm: Any, folder: str, n: int, m: int) -> dict[str, torch.Tensor]:
    """Train ``n`` steps, save everything per rank, go on ``m`` steps (uninterrupted)."""
    out = {}
    for mode in MODES:
        for label, method, hyper in METHODS:
            model, state, opt = _setup(mode, method, hyper, comm)
            _steps(model, opt, comm.rank, 0, n)
            path = os.path.join(folder, f"{mode}-{label}-rank{comm.rank}.pt")
            torch.save(
                {
                    "model": _inner(model).state_dict(),
                    "optim": opt.state_dict(),
                    "sparcml": state.state_dict(),
                },
                path,
            )
            _steps(model, opt, comm.rank, n, n + m)
            out[f"{mode}-{label}"] = flat_params(_inner(model))
    return out


def resumed_run(comm: Any, folder: str, n: int, m: int) -> dict[str, torch.Tensor]:
    """Fresh processes: restore and go on ``m`` steps; ``...-nostate`` entries restore
    model and optimizer only (the sparcml state starts empty)."""
    out = {}
    for mode in MODES:
        for label, method, hyper in METHODS:
            variants = [True, False] if label in ("topk", "oktopk") else [True]
            for with_state in variants:
                model, state, opt = _setup(mode, method, hyper, comm)
                path = os.path.join(folder, f"{mode}-{label}-rank{comm.rank}.pt")
                ck = torch.load(path, weights_only=True)  # plain data only
                _inner(model).load_state_dict(ck["model"])
                opt.load_state_dict(ck["optim"])
                if with_state:
                    state.load_state_dict(ck["sparcml"])
                else:
                    state.step = ck["sparcml"]["step"]  # (only the step counter)
                _steps(model, opt, comm.rank, n, n + m)
                suffix = "" if with_state else "-nostate"
                out[f"{mode}-{label}{suffix}"] = flat_params(_inner(model))
    return out
