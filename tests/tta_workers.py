"""Rank functions for the PyTorch peer methods (module level: spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sparcml.torch.peers import register_peer


def peer_steps(comm: Any, methods: list[str], steps: int, start_iter: int) -> dict[str, Any]:
    """A few DDP steps of a 2-layer MLP with each of PyTorch's ``methods``."""
    return {m: _steps(comm, m, steps, start_iter) for m in methods}


def _steps(comm: Any, method: str, steps: int, start_iter: int) -> dict[str, Any]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(mlp)
    state = register_peer(model, method, start_iter=start_iter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(comm.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        state.after_backward()
        opt.step()
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "bytes": list(state.step_bytes), "params": flat, "hyper": state.hyper}


class _SparseLinear(torch.nn.Module):
    """A logistic regression's shape: an EmbeddingBag(100, 1, sparse=True) and a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(100, 1, mode="sum", sparse=True)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids, torch.tensor([0])).sum() + self.bias.sum()


def sparse_ddp_bytes(comm: Any) -> dict[str, Any]:
    """Plain DDP (PyTorch's sparse allreduce) of :class:`_SparseLinear`: rank r's batch
    touches rows r, r + 2, ..., r + 8 and row 50 (shared)."""
    torch.manual_seed(0)
    model = DDP(_SparseLinear())
    state = register_peer(model, "ddp")
    model(torch.tensor([comm.rank + 2 * i for i in range(5)] + [50])).backward()
    state.after_backward()
    rows = int(model.module.emb.weight.grad.coalesce().indices().shape[1])
    return {"bytes": list(state.step_bytes), "rows": rows}
