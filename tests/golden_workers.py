"""Rank function of the golden pipeline test (module level: spawned processes import it).

Every training method through every entry point (the DDP hook, ``sync_gradients``,
FSDP2's reduce-scatter, the per-tensor SGD steps) for a few steps of plain SGD
(lr 0.1, no momentum) under fixed seeds; per case, this rank's bytes per step and a
SHA-256 of the final parameters' bytes. :func:`golden_runs` runs every case in one
process group, so the whole table costs one spawn.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch

import sparcml
import sparcml.torch as st

STEPS = 6
LR = 0.1
TOPK = {"density": 0.1, "seed": 0}
#: a calibration file that does not exist: the cost model's default constants
NO_CALIBRATION = "/nonexistent/sparcml-golden/calibration.json"

# (method, options label, options) on the dense MLP
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("dense", "", {"seed": 0}),
    ("fp16", "", {"seed": 0}),
    ("bf16", "", {"seed": 0}),
    ("nonzeros", "", {"seed": 0}),
    ("natural", "", {"seed": 0}),
    ("qsgd", "", {"seed": 0}),
    ("dithering", "", {"seed": 0}),
    ("natural_dithering", "", {"seed": 0}),
    ("topk", "", TOPK),
    ("topk+natural", "", TOPK),
    ("topk+qsgd", "", TOPK),
    ("trimmed_topk", "", TOPK),
    ("randomk", "", TOPK),
    ("gaussiank", "", TOPK),
    ("blocktopk", "", TOPK),
    ("threshold_bsearch", "", TOPK),
    ("sampled_threshold_bsearch", "", TOPK),
    ("threshold_reuse", "", TOPK),
    ("oktopk", "", TOPK),
    ("oktopk", "tau=2,tau_prime=1", {**TOPK, "tau": 2, "tau_prime": 1}),
    ("redsync", "min_bytes=0", {**TOPK, "min_bytes": 0}),
    ("redsync", "min_bytes=0,asq", {**TOPK, "min_bytes": 0, "asq": True}),
    ("redsync", "default", TOPK),  # (every layer under 128 KB: sent whole)
]
# pipeline options, on topk
OPTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("topk", "warmup_steps=2", {**TOPK, "warmup_steps": 2}),
    # (recorded when masking was the default: kept on, by name)
    ("topk", "momentum=0.9", {**TOPK, "momentum": 0.9, "momentum_masking": True}),
    ("topk", "momentum=0.9,no_masking", {**TOPK, "momentum": 0.9, "momentum_masking": False}),
    ("topk", "clip_norm=1.0", {**TOPK, "clip_norm": 1.0}),
    ("topk", "clip_norm=1.0,model", {**TOPK, "clip_norm": 1.0, "clip_scope": "model"}),
    ("topk", "error_feedback=False", {**TOPK, "error_feedback": False}),
    ("topk", "layers=*.bias:dense", {**TOPK, "layers": [("*.bias", "dense")]}),
    ("topk", "layers=*.bias:natural", {**TOPK, "layers": [("*.bias", "natural")]}),
    ("topk", "dense_below=100", {**TOPK, "dense_below": 100}),
    ("topk", "bucket_bytes=1000", {**TOPK, "bucket_bytes": 1000}),
    ("topk", "nan_policy=raise", {**TOPK, "nan_policy": "raise"}),
    ("topk", "seed=1", {"density": 0.1, "seed": 1}),
    ("randomk", "seed=1", {"density": 0.1, "seed": 1}),
]
# FSDP2's reduce-scatter: dense, nonzeros, quantizers, selectors (no rules, momentum,
# clipping, oktopk, redsync)
FSDP = [
    c
    for c in METHODS + OPTIONS
    if c[0] not in ("fp16", "bf16", "oktopk", "redsync")
    and not (
        {"momentum", "clip_norm", "layers", "dense_below", "bucket_bytes", "nan_policy"}
        & c[2].keys()
    )
]
# nn.Embedding(sparse=True): the methods that take sparse gradients
SPARSE = [
    ("dense", "", {"seed": 0}),
    ("nonzeros", "", {"seed": 0}),
    ("topk", "", TOPK),
    ("topk", "density=1.0", {"density": 1.0, "seed": 0}),
    ("randomk", "", TOPK),
    ("topk", "warmup_steps=2", {**TOPK, "warmup_steps": 2}),
    # (recorded when masking was the default: kept on, by name)
    ("topk", "momentum=0.9", {**TOPK, "momentum": 0.9, "momentum_masking": True}),
    ("natural", "layers=emb.*:nonzeros", {"seed": 0, "layers": [("emb.*", "nonzeros")]}),
]


def cases() -> list[tuple[str, str, str, dict[str, Any]]]:
    """Every ``(entry point, method, options label, options)``."""
    out = []
    for entry in ("ddp", "sync"):
        out += [(entry, m, label, o) for m, label, o in METHODS + OPTIONS]
        # (a DDP hook sees one bucket at a time: register() refuses clip_scope="model")
        out = [c for c in out if not (c[0] == "ddp" and c[3].get("clip_scope") == "model")]
        out += [(f"{entry}-embedding", m, label, o) for m, label, o in SPARSE]
    out += [("fsdp", m, label, o) for m, label, o in FSDP]
    out += [
        ("topk_sgd_step", "topk", "density=0.1", {"density": 0.1}),
        ("topk_sgd_step", "topk+natural", "density=0.1", {"density": 0.1, "quantizer": "natural"}),
        ("topk_sgd_step", "topk", "k=5,lr=None", {"k": 5, "lr": None}),
        ("oktopk_sgd_step", "oktopk", "density=0.1", {"density": 0.1}),
    ]
    return out


def key(entry: str, method: str, label: str) -> str:
    return f"{entry}|{method}|{label}" if label else f"{entry}|{method}"


# ---------------------------------------------------------------- models and data
class _Embedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.fc = torch.nn.Linear(8 + 20, 10)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(ids).mean(1), x], 1))


def _model(embedding: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if embedding:
        return _Embedding()
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(16, 20, generator=g)
    ids = torch.randint(0, 50, (16, 3), generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    return x, ids, y


def _loss(model: Any, rank: int, step: int, embedding: bool) -> torch.Tensor:
    x, ids, y = _batch(rank, step)
    out = model(x, ids) if embedding else model(x)
    return torch.nn.functional.cross_entropy(out, y)


def _digest(params: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The final parameters' SHA-256 (every bit) and their fingerprint: the norm and
    three projections on fixed random directions of all parameters as one float64
    vector, which a CPU with other kernels (AVX-512 against AVX2: other summation
    orders) moves by rounding only."""
    h = hashlib.sha256()
    for _, p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    flat = torch.cat([p.detach().cpu().double().flatten() for _, p in params])
    g = torch.Generator().manual_seed(12345)
    directions = torch.randn(3, flat.numel(), generator=g, dtype=torch.float64)
    fingerprint = [float(flat.norm()), *(float(d @ flat) for d in directions)]
    return {"hash": h.hexdigest(), "fingerprint": fingerprint}


# ---------------------------------------------------------------- entry points
def _train(model: Any, rank: int, embedding: bool, after_backward: Callable[[], None]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for t in range(STEPS):
        loss = _loss(model, rank, t, embedding)
        opt.zero_grad()
        loss.backward()
        after_backward()
        opt.step()


def _ddp(comm: Any, method: str, opts: dict[str, Any], embedding: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = _model(embedding)
    model = DDP(module, bucket_cap_mb=0.002)  # (a few buckets)
    state = st.register(model, method=method, **opts)
    _train(model, comm.rank, embedding, lambda: None)
    return {"step_bytes": list(state.step_bytes), **_digest(list(module.named_parameters()))}


def _sync(comm: Any, method: str, opts: dict[str, Any], embedding: bool) -> dict[str, Any]:
    model = _model(embedding)
    state = st.SparcmlState(method, **opts)
    _train(model, comm.rank, embedding, lambda: st.sync_gradients(model, state))
    return {"step_bytes": list(state.step_bytes), **_digest(list(model.named_parameters()))}


def _fsdp(comm: Any, method: str, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = st.register_fsdp(model, method=method, **opts)
    _train(model, comm.rank, False, lambda: None)
    full = [(n, p.full_tensor()) for n, p in model.named_parameters()]
    return {"step_bytes": list(state.step_bytes), **_digest(full)}


def _sgd_step(comm: Any, method: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``topk_sgd_step`` / ``oktopk_sgd_step`` per parameter; ``w -= g / P``."""
    opts = dict(opts)
    model = _model()
    ef = sparcml.ErrorFeedback()
    lr = opts.pop("lr", LR)
    density = opts.pop("density", None)
    ok_states: dict[str, Any] = {}
    step_bytes = []
    for t in range(STEPS):
        model.zero_grad()
        _loss(model, comm.rank, t, False).backward()
        before = comm.stats.bytes_sent
        with torch.no_grad():
            for name, p in model.named_parameters():
                assert p.grad is not None
                if method == "oktopk":
                    k = max(1, round(density * p.numel()))
                    ok = ok_states.setdefault(name, sparcml.OkTopkState(tau=2, tau_prime=1))
                    g = st.oktopk_sgd_step(p.grad, name, ef, ok, k, comm, lr=lr)
                else:
                    g = st.topk_sgd_step(p.grad, name, ef, comm, density=density, lr=lr, **opts)
                if lr is None:
                    g = g * LR
                p.sub_(g / comm.world_size)
        step_bytes.append(comm.stats.bytes_sent - before)
    return {"step_bytes": step_bytes, **_digest(list(model.named_parameters()))}


def run_case(comm: Any, entry: str, method: str, opts: dict[str, Any]) -> dict[str, Any]:
    embedding = entry.endswith("-embedding")
    base = entry.removesuffix("-embedding")
    if base == "ddp":
        return _ddp(comm, method, opts, embedding)
    if base == "sync":
        return _sync(comm, method, opts, embedding)
    if base == "fsdp":
        return _fsdp(comm, method, opts)
    return _sgd_step(comm, method, opts)


def golden_runs(comm: Any) -> dict[str, dict[str, Any]]:
    """Every case of :func:`cases` on this rank: ``{key: {step_bytes, hash,
    fingerprint}}`` (or
    ``{error}`` where a case raised; the ranks go on with the next case).

    ``algorithm="auto"`` decides by the default cost model: never by timing calls
    (``SPARCML_AUTO=measure``) nor by this machine's calibration file, either of
    which could pick another algorithm (other bytes, other rounding) from run to run.
    """
    os.environ["SPARCML_AUTO"] = "model"
    os.environ["SPARCML_CALIBRATION"] = NO_CALIBRATION
    out: dict[str, dict[str, Any]] = {}
    for entry, method, label, opts in cases():
        try:
            out[key(entry, method, label)] = run_case(comm, entry, method, opts)
        except Exception as e:  # recorded: the comparison names the case
            out[key(entry, method, label)] = {"error": f"{type(e).__name__}: {e}"}
    return out
