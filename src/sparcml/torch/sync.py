"""Gradient synchronisation without DDP: explicit call, optimizer wrapper, broadcast.

For training loops that do not use DDP, and for the MPI transport::

    state = sparcml.torch.SparcmlState("topk", density=0.01, comm=MPICommunicator())
    sparcml.torch.broadcast_parameters(model, state)
    ...
    loss.backward()
    sparcml.torch.sync_gradients(model, state)   # grads now hold the average
    optimizer.step()

Parameters are grouped into buckets of about ``state.bucket_bytes`` in
registration order; every bucket goes through the same pipeline as the DDP hook
(:func:`~sparcml.torch.reduce.reduce_bucket`), submitted to the engine so the
buckets' collectives run back to back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..stream import SparseStream
from ..wire import decode, encode
from .hook import check_parameters, check_settings, named_parameters_of
from .reduce import Bucket, reduce_bucket
from .state import SparcmlState

__all__ = ["DistributedOptimizer", "broadcast_parameters", "sync_gradients"]


def _attach(state: SparcmlState, named: list[tuple[str, torch.Tensor]]) -> None:
    ids = [id(p) for _, p in named]
    if state.registered is None:
        check_settings(state)
        check_parameters(state, named, values=True)
        state.param_names = {id(p): n for n, p in named}
        state.registered = "sync_gradients"
        state._sync_ids = ids  # type: ignore[attr-defined]
    elif getattr(state, "_sync_ids", None) != ids:
        raise ValueError(
            "this state synchronises another set of parameters (or the DDP hook); "
            "use one SparcmlState per model"
        )


def _buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > bucket_bytes or p.dtype != cur[0][1].dtype):
            out.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += nbytes
    if cur:
        out.append(cur)
    return out


def _model_clip_scale(
    state: SparcmlState, named: list[tuple[str, torch.Tensor]], step: int
) -> float | None:
    """RedSync's local clipping (sec. 3.5) of the whole local gradient to
    ``clip_norm / sqrt(P)``: the factor, or None (not clipping this step)."""
    if state.clip_norm is None or state.clip_scope != "model":
        return None
    if step < state.warmup_steps or state.kind == "dense":
        return None  # (dense steps are not clipped, as in the per-bucket pipeline)
    grads = [p.grad.detach().reshape(-1) for _, p in named if p.grad is not None]
    if not grads:
        return None
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    )))  # fmt: skip
    limit = state.clip_norm / math.sqrt(state.comm.world_size)
    return limit / (norm + 1e-12) if norm > limit else None


def sync_gradients(model: torch.nn.Module | Iterable[torch.Tensor], state: SparcmlState) -> None:
    """Replace every parameter's ``.grad`` by the method's average over the ranks.

    A collective: every rank calls it once per step with the same parameters. The
    first call checks that every rank has the same parameters (names, shapes,
    order and values). Parameters without a gradient count as zero.

    Args:
        model: a module (its parameters with ``requires_grad``) or a list of tensors.
        state: the :class:`SparcmlState` (one per model).

    Raises:
        RankMismatchError: the ranks' parameters, methods or hyperparameters differ
            (on the first call, on every rank).
        FloatingPointError: a NaN/Inf gradient with ``nan_policy="raise"``.
        CommTimeoutError / PeerFailedError: naming a rank that stopped answering.
    """
    named = named_parameters_of(model)
    _attach(state, named)
    step = state.step
    works = []
    groups = _buckets(named, state.bucket_bytes)
    scale = _model_clip_scale(state, named, step)
    for group in groups:
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                for _, p in group
            ]
        )
        if scale is not None:
            flat.mul_(scale)
        item = Bucket(tuple(n for n, _ in group), tuple(p.numel() for _, p in group), flat, step)
        works.append(state.comm.run_ordered(lambda item=item: reduce_bucket(state, item), True))
    state.step += 1
    for group, work in zip(groups, works, strict=True):
        avg = work.wait()
        for (_, p), part in zip(group, avg.split([q.numel() for _, q in group]), strict=True):
            g = part.view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def broadcast_parameters(
    model: torch.nn.Module | Iterable[torch.Tensor], state: SparcmlState, root: int = 0
) -> None:
    """Copy ``root``'s parameter values to every rank (a collective; before training).

    Uses the state's communicator, so it works on every transport (MPI included).
    """
    comm = state.comm
    named = named_parameters_of(model)
    if comm.world_size == 1:
        return
    flat = torch.cat([p.detach().reshape(-1) for _, p in named]) if named else torch.zeros(0)
    if comm.rank == root:
        payload = encode(SparseStream.dense(flat.cpu().clone()))
        sends = [comm.isend(payload, r) for r in range(comm.world_size) if r != root]
        for h in sends:
            h.wait()
        return
    got = decode(comm.recv(root), expect_size=flat.numel(), expect_dtype=flat.dtype).to_dense()
    offset = 0
    with torch.no_grad():
        for _, p in named:
            n = p.numel()
            p.copy_(got[offset : offset + n].view_as(p))
            offset += n


class DistributedOptimizer:
    """Wrap an optimizer so that ``step()`` first synchronises the gradients.

    Args:
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        model: the module (or parameter list) whose gradients to synchronise.
        state: the :class:`SparcmlState`.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> state = sparcml.torch.SparcmlState("topk", density=0.5)
        >>> opt = sparcml.torch.DistributedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1), model, state)
        >>> model(torch.ones(3, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> state.step
        1
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | Iterable[torch.Tensor],
        state: SparcmlState,
    ) -> None:
        self.optimizer = optimizer
        self.model = model if isinstance(model, torch.nn.Module) else list(model)
        self.state = state

    def step(self, closure: Any = None) -> Any:
        sync_gradients(self.model, self.state)
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
