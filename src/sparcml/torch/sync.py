"""Gradient synchronisation without DDP: explicit call, optimizer wrapper, broadcast.

For training loops that do not use DDP, and for the MPI transport::

    state = sparcml.torch.SparcmlState("topk", density=0.01, comm=MPICommunicator())
    sparcml.torch.broadcast_parameters(model, state)
    ...
    loss.backward()
    sparcml.torch.sync_gradients(model, state)   # grads now hold the average
    optimizer.step()

Parameters are grouped into buckets of about ``state.settings.bucket_bytes`` in
registration order; every bucket goes through the same pipeline as the DDP hook
(:func:`~sparcml.torch.reduce.reduce_bucket`), submitted to the engine so the
buckets' collectives run back to back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from ..reinterpret import as_bytes, bytes_as
from .hook import (
    check_parameters,
    check_settings,
    check_sparse_gradients,
    named_parameters_of,
    sparse_gradient_parameters,
)
from .reduce import Bucket, reduce_bucket, reduce_sparse_gradient
from .state import SparcmlState
from .stats import log_step

__all__ = [
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "sync_gradients",
]

log = logging.getLogger("sparcml")


def _attach(state: SparcmlState, named: list[tuple[str, torch.Tensor]], model: Any = None) -> None:
    ids = [id(p) for _, p in named]
    if state.registered is None:
        sparse = sparse_gradient_parameters(model)
        if sparse and state.settings.clip_norm is not None and state.settings.clip_scope == "model":
            raise ValueError(
                f"clip_scope='model' with the sparse-gradient parameter {sparse[0][0]!r}: "
                "clip per bucket (clip_scope='bucket') or densify the embedding"
            )
        state.sparse_ids = {id(p) for _, p in sparse}
        check_sparse_gradients(state, model)
        check_settings(state)
        check_parameters(state, named, values=True)
        state.set_parameters(named)
        state.registered = "sync_gradients"
        state.sync_ids = ids
    elif state.sync_ids != ids:
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
    settings = state.settings
    if settings.clip_norm is None or settings.clip_scope != "model":
        return None
    if step < settings.warmup_steps or state.groups[0].spec.reference:
        return None  # (dense steps are not clipped, as in the per-bucket pipeline)
    grads = [
        p.grad.detach().reshape(-1) for _, p in named if p.grad is not None and not p.grad.is_sparse
    ]
    if not grads:
        return None
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    )))  # fmt: skip
    limit = settings.clip_norm / math.sqrt(state.comm.world_size)
    return limit / (norm + 1e-12) if norm > limit else None


@dataclasses.dataclass
class _Item:
    """One unit of reduction: a bucket of dense-gradient parameters, or one
    sparse-gradient parameter (reduced as a sparse stream)."""

    params: list[tuple[str, torch.Tensor]]
    sparse: bool

    def submit(self, state: SparcmlState, step: int, scale: float | None) -> Any:
        """Hand this item's current gradients to the state's engine; returns the work."""
        if self.sparse:
            ((name, p),) = self.params  # (reduce_sparse_gradient checks its method)
            item = Bucket((name,), (p.numel(),), _sparse_grad(p), step)
            return state.comm.run_ordered(lambda: reduce_sparse_gradient(state, item), True)
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                for _, p in self.params
            ]
        )
        if scale is not None:
            flat.mul_(scale)
        names = tuple(n for n, _ in self.params)
        sizes = tuple(p.numel() for _, p in self.params)
        bucket = Bucket(names, sizes, flat, step)
        return state.comm.run_ordered(lambda: reduce_bucket(state, bucket), True)

    def finish(self, work: Any) -> None:
        """Write the reduced average into the parameters' ``.grad``."""
        avg = work.wait()
        if self.sparse:
            self.params[0][1].grad = avg
            return
        for (_, p), part in zip(
            self.params, avg.split([q.numel() for _, q in self.params]), strict=True
        ):
            g = part.view_as(p)
            if p.grad is None or p.grad.is_sparse:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def _plan(state: SparcmlState, named: list[tuple[str, torch.Tensor]]) -> list[_Item]:
    """The reduction units in the order they are reduced: buckets of about
    ``bucket_bytes`` in registration order (a sparse-gradient parameter is a unit
    of its own), reduced last first, as backward produces the gradients (DDP's
    order): :class:`DistributedOptimizer` can then start each as soon as it is
    ready, and gives the same results as :func:`sync_gradients`."""
    sparse_ids = state.sparse_ids
    items: list[_Item] = []
    run: list[tuple[str, torch.Tensor]] = []
    for name, p in named:
        if id(p) in sparse_ids or _has_sparse_grad(p):
            items += [_Item(b, False) for b in _buckets(run, state.settings.bucket_bytes)]
            items.append(_Item([(name, p)], True))
            run = []
        else:
            run.append((name, p))
    items += [_Item(b, False) for b in _buckets(run, state.settings.bucket_bytes)]
    return items[::-1]


def sync_gradients(model: torch.nn.Module | Iterable[torch.Tensor], state: SparcmlState) -> None:
    """Replace every parameter's ``.grad`` by the method's average over the ranks.

    A collective: every rank calls it once per step with the same parameters. The
    first call checks that every rank has the same parameters (names, shapes,
    order and values). Parameters without a gradient count as zero. Sparse COO
    gradients (``nn.Embedding(..., sparse=True)``) stay sparse: each is reduced
    as a sparse stream (see :func:`~sparcml.torch.reduce.reduce_sparse_gradient`).

    Args:
        model: a module (its parameters with ``requires_grad``) or a list of tensors.
        state: the :class:`SparcmlState` (one per model).

    Raises:
        RankMismatchError: the ranks' parameters, methods or hyperparameters differ
            (on the first call, on every rank).
        ValueError: a sparse-gradient parameter's method cannot reduce it.
        FloatingPointError: a NaN/Inf gradient with ``nan_policy="raise"``.
        CommTimeoutError / PeerFailedError: naming a rank that stopped answering.
    """
    named = named_parameters_of(model)
    _attach(state, named, model)
    step = state.step
    items = _plan(state, named)
    scale = _model_clip_scale(state, named, step)
    works = [item.submit(state, step, scale) for item in items]
    state.step += 1
    for item, work in zip(items, works, strict=True):
        item.finish(work)
    log_step(state)


def _has_sparse_grad(p: torch.Tensor) -> bool:
    return p.grad is not None and p.grad.is_sparse


def _sparse_grad(p: torch.Tensor) -> torch.Tensor:
    """The parameter's gradient as a COO tensor (an empty one when it has none)."""
    g = p.grad
    if g is None:
        return torch.sparse_coo_tensor(
            torch.zeros((1, 0), dtype=torch.int64, device=p.device),
            torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
            p.shape,
        )
    return g if g.is_sparse else g.to_sparse(1 if g.dim() > 1 else None)


def broadcast_parameters(
    model: torch.nn.Module | Iterable[torch.Tensor], state: SparcmlState, root: int = 0
) -> None:
    """Copy ``root``'s parameters and buffers to every rank (a collective; before
    training), as DDP does at construction: every parameter of a module, frozen ones
    included, and its buffers (BatchNorm's running statistics); of an iterable, every
    tensor in it. Their bytes travel unchanged, whatever their dtypes.

    Uses the state's communicator, so it works on every transport (MPI included).

    Raises:
        ValueError: this rank's tensors do not have root's size in bytes.
    """
    comm = state.comm
    if isinstance(model, torch.nn.Module):
        tensors = [*model.parameters(), *model.buffers()]
    else:
        tensors = [p for _, p in named_parameters_of(list(model), trainable_only=False)]
    if comm.world_size == 1:
        return
    raw = [as_bytes(t.detach()) for t in tensors]
    # the layout's fingerprint first: equal sizes of other shapes or dtypes are refused
    layout = ";".join(f"{t.dtype}:{tuple(t.shape)}" for t in tensors).encode()
    sign = torch.frombuffer(bytearray(hashlib.sha256(layout).digest()[:8]), dtype=torch.uint8)
    flat = torch.cat([sign, *(b.cpu() for b in raw)])
    if comm.rank == root:
        sends = [comm.isend(flat, r) for r in range(comm.world_size) if r != root]
        for h in sends:
            h.wait()
        return
    got = comm.recv(root).cpu()
    if got.numel() != flat.numel() or not torch.equal(got[:8], sign):
        raise ValueError(
            f"broadcast_parameters: root {root}'s parameters and buffers differ from rank "
            f"{comm.rank}'s in number, shape or dtype ({got.numel() - 8} bytes against "
            f"{flat.numel() - 8})"
        )
    offset = 8
    with torch.no_grad():
        for t, b in zip(tensors, raw, strict=True):
            n = b.numel()
            t.copy_(bytes_as(got[offset : offset + n], t.dtype).view(t.shape))
            offset += n


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, state: SparcmlState, root: int = 0
) -> None:
    """Copy ``root``'s optimizer state (momentum buffers, step counts, learning rates
    and every other hyperparameter) to every rank: Horovod's
    ``broadcast_optimizer_state``. A collective; call it after
    :func:`broadcast_parameters`, e.g. after ``root`` loaded a checkpoint.

    The state dict travels as ``torch.save`` bytes over the state's communicator
    (every transport) and is read back with ``weights_only=True``.
    """
    comm = state.comm
    if comm.world_size == 1:
        return
    if comm.rank == root:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sends = [comm.isend(payload, r) for r in range(comm.world_size) if r != root]
        for h in sends:
            h.wait()
        return
    got = comm.recv(root)
    loaded = torch.load(io.BytesIO(bytes(got.cpu().numpy())), weights_only=True)
    optimizer.load_state_dict(loaded)


class DistributedOptimizer:
    """Wrap an optimizer so that its gradients are synchronised before each ``step()``.

    With ``overlap=True`` (the default) each bucket's reduction starts during
    backward, as soon as the last of its gradients is accumulated (a
    post-accumulate-grad hook per parameter), in the fixed order of
    :func:`sync_gradients` (last bucket first, the order backward produces them;
    a bucket finishing early waits for its predecessors so every rank reduces in
    the same order): communication overlaps the rest of backward, as DDP's hook
    does, and the results are bitwise those of :func:`sync_gradients`. ``step()``
    reduces what was not ready (parameters without a gradient count as zero),
    waits, writes the averages into ``.grad`` and steps the optimizer.

    Args:
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        model: the module (or parameter list) whose gradients to synchronise.
        state: the :class:`SparcmlState`.
        overlap: start reductions during backward (False: all in ``step()``).
            ``clip_scope="model"`` needs the whole gradient first and turns it off.
        backward_passes_per_step: Horovod's gradient accumulation: gradients of
            this many backward passes add up locally (scale the loss by ``1/k``
            for their mean) and are reduced once, during the last pass; call
            ``step()`` after every ``k``-th backward.

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
        *,
        overlap: bool = True,
        backward_passes_per_step: int = 1,
    ) -> None:
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be a positive integer, got "
                f"{backward_passes_per_step!r}"
            )
        self.optimizer = optimizer
        self.model = model if isinstance(model, torch.nn.Module) else list(model)
        self.state = state
        self.backward_passes_per_step = backward_passes_per_step
        clips_model = state.settings.clip_norm is not None and state.settings.clip_scope == "model"
        self.overlap = overlap and not clips_model
        if overlap and not self.overlap:
            log.info("sparcml DistributedOptimizer: clip_scope='model' needs the whole "
                     "gradient; reducing in step(), without overlap")  # fmt: skip
        self._hooks: list[Any] = []
        self._items: list[_Item] = []
        if self.overlap:
            named = named_parameters_of(self.model)
            _attach(state, named, self.model)  # a collective: every rank constructs one
            self._items = _plan(state, named)
            self._item_of = {id(p): i for i, it in enumerate(self._items) for _, p in it.params}
            self._need = [len(it.params) * backward_passes_per_step for it in self._items]
            for _, p in named:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))
            self._reset()

    def _reset(self) -> None:
        self._count = [0] * len(self._items)
        self._passes: dict[int, int] = {}  # backward passes per parameter since step()
        self._works: list[Any] = [None] * len(self._items)
        self._next = 0

    def _accumulated(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: submit every bucket that is ready, in order.

        Raises:
            RuntimeError: a parameter's gradient arrives more than
                ``backward_passes_per_step`` times before ``step()`` (as Horovod
                does): its bucket may already be reducing, and the extra pass would
                be lost or mixed into the next step without a word.
        """
        i = self._item_of.get(id(p))
        if i is None or not self.overlap:
            return
        passes = self._passes.get(id(p), 0)
        if passes >= self.backward_passes_per_step:
            k = self.backward_passes_per_step
            raise RuntimeError(
                f"sparcml DistributedOptimizer: a gradient was computed {passes + 1} times "
                f"before step(), with backward_passes_per_step={k}: its bucket's reduction "
                f"starts once every gradient in it has had {k} pass(es) (overlap=True), so "
                f"the extra pass would be lost. Call step() after every {k} backward pass(es), "
                "or pass backward_passes_per_step= to accumulate; to drop a batch after "
                "its backward, construct with overlap=False (reduces in step() only)"
            )
        self._passes[id(p)] = passes + 1
        self._count[i] += 1
        self._submit_ready()

    def _submit_ready(self, flush: bool = False) -> None:
        items, state = self._items, self.state
        while self._next < len(items) and (
            flush or self._count[self._next] >= self._need[self._next]
        ):
            self._works[self._next] = items[self._next].submit(state, state.step, None)
            self._next += 1

    def synchronize(self) -> None:
        """Finish the reductions (starting what backward did not) and write ``.grad``."""
        if not self.overlap:
            sync_gradients(self.model, self.state)
            return
        self._submit_ready(flush=True)
        self.state.step += 1
        try:
            for item, work in zip(self._items, self._works, strict=True):
                item.finish(work)
        finally:
            self._reset()
        log_step(self.state)

    def step(self, closure: Any = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``.

        Raises:
            RuntimeError: with ``overlap=True``, after a backward and before its
                ``step()`` (or :meth:`synchronize`): that backward's reductions have
                started, and the next ``step()`` would apply them (Horovod refuses
                this too). Call ``synchronize()`` first to finish and discard them,
                or construct with ``overlap=False`` to drop batches after backward.
        """
        if self.overlap and (self._passes or self._next):
            raise RuntimeError(
                "sparcml DistributedOptimizer: zero_grad() after a backward and before "
                "step(): that backward's reductions already started (overlap=True) and "
                "step() would apply them. Call opt.synchronize() first (then zero_grad() "
                "clears their result), or construct with overlap=False to drop a batch "
                "after its backward"
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the post-accumulate-grad hooks (the optimizer then reduces in step())."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.overlap = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
