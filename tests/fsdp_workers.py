"""Rank functions of the FSDP2 tests (module level: spawned processes import them)."""

from __future__ import annotations

import io
from typing import Any

import torch

import sparcml.torch as st
from train_workers import batch, make_model


def _sharded(reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model()
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _full(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _train(model: torch.nn.Module, opt: Any, rank: int, start: int, stop: int) -> list[float]:
    losses = []
    for t in range(start, stop):
        x, y = batch(rank, t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def fsdp_runs(
    comm: Any, runs: list[tuple[str, str | None, dict[str, Any]]], steps: int
) -> dict[str, dict[str, Any]]:
    """Every run in one process: ``(label, method or None for plain FSDP, hyper)``."""
    out = {}
    for label, method, hyper in runs:
        hyper = dict(hyper)
        reduce_dtype = hyper.pop("reduce_dtype", None)
        divide = hyper.pop("divide_factor", None)
        lr = hyper.pop("lr", 0.2)
        model = _sharded(reduce_dtype)
        if divide is not None:
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(divide)
        state = st.register_fsdp(model, method, **hyper) if method else None
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = _train(model, opt, comm.rank, 0, steps)
        numel = sum(p.numel() for p in model.parameters())
        out[label] = {
            "params": _full(model),
            "losses": losses,
            "step_bytes": list(state.step_bytes) if state else [],
            "numel": numel,
            "stats": state.stats.as_dict() if state else {},
        }
    return out


def fsdp_resume(comm: Any, method: str, hyper: dict[str, Any], n: int, m: int) -> dict[str, Any]:
    """Train n steps, save per rank, go on m; then a fresh model, optimizer and state
    (a new sparcml process group) restore and go on m steps."""
    model = _sharded()
    state = st.register_fsdp(model, method, **hyper)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    _train(model, opt, comm.rank, 0, n)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    sparcml_buf = io.BytesIO()
    torch.save(state.state_dict(), sparcml_buf)
    _train(model, opt, comm.rank, n, n + m)
    out = {"uninterrupted": _full(model)}
    for with_state in (True, False):
        model = _sharded()
        state = st.register_fsdp(model, method, **hyper)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        buf.seek(0)
        ck = torch.load(buf, weights_only=False)  # (DTensors)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        if with_state:
            sparcml_buf.seek(0)
            state.load_state_dict(torch.load(sparcml_buf, weights_only=True))
        _train(model, opt, comm.rank, n, n + m)
        out["resumed" if with_state else "nostate"] = _full(model)
    return out


def fsdp_nan_skip(
    comm: Any, method: str | None, hyper: dict[str, Any], steps: int
) -> dict[str, Any]:
    """The GradScaler pattern under FSDP2: rank 1's gradient is NaN at step 1, and every
    rank skips ``opt.step()`` when any gradient shard is non-finite; after it, were
    the steps finite, and is the sparcml state (residuals) finite?"""
    import torch.distributed as dist

    model = _sharded()
    state = st.register_fsdp(model, method, **hyper) if method else None
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    skipped = []
    for t in range(steps):
        x, y = batch(comm.rank, t)
        if t == 1 and comm.rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        bad = torch.tensor([0.0])
        for p in model.parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad.to_local()).all()):
                bad += 1
        dist.all_reduce(bad)
        skipped.append(bool(bad.item()))
        if not skipped[-1]:
            opt.step()
    finite_state = True
    if state is not None:
        for group in state.groups:
            for buf in group.feedback.buffers.values():
                finite_state &= bool(torch.isfinite(buf).all())
    return {"skipped": skipped, "params": _full(model), "finite_state": finite_state}


def fsdp_register_on_each_rank(
    comm: Any, setups: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Rank r registers ``setups[r]`` (method, hyper); what it raised and when."""
    import time

    method, hyper = setups[comm.rank]
    model = _sharded()
    t0 = time.monotonic()
    try:
        st.register_fsdp(model, method, timeout=20, **hyper)
        out: dict[str, Any] = {"type": "no error", "message": ""}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e)}
    out["seconds"] = time.monotonic() - t0
    # every rank alive a while: rank 1 so that the others must not wait for it to
    # die; the others so that rank 0's rendezvous store outlives a slower rank's
    # check-in (under torchrun the agent holds it)
    time.sleep(2)
    return out


def fsdp_grouped_modules(comm: Any, steps: int) -> tuple[list[int], list[float]]:
    """``fully_shard([a, b])`` (two modules, one parameter group), then the root: the
    state's step after each training step, and the first parameters."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard([model[0], model[2]])
    fully_shard(model)
    state = st.register_fsdp(model, "dense")
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    after = []
    for t in range(steps):
        _train(model, opt, comm.rank, t, t + 1)
        after.append(state.step)
    return after, _full(model).tolist()[:4]
