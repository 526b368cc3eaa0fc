"""DDP communication hook: PyTorch's ``(state, GradBucket) -> Future[Tensor]`` shape.

Usage (three lines in a working ``torchrun`` DDP script)::

    import sparcml.torch
    model = DDP(model)
    sparcml.torch.register(model, method="topk", density=0.01)

The hook hands each bucket to the state's background engine and returns at
once, so the collective overlaps the rest of backward (SparCML sec. 7's
non-blocking operations); DDP waits on the returned future before the optimizer
step. Buckets are reduced in the order DDP hands them over, the same on every
rank.

Errors keep their type. DDP turns an exception carried by a hook's future into
a ``RuntimeError`` holding only its text, so the hook completes its future with
the bucket's local gradient instead and re-raises the stored exception on the
training thread at the end of the same ``loss.backward()`` (an autograd final
callback queued behind DDP's own): ``backward()`` raises the documented
``FloatingPointError``, ``CommTimeoutError``, ``PeerFailedError`` (with
``.peer``), ``RankMismatchError`` ... itself, and the optimizer step is never
reached. Should that callback not run, the error is raised by the next hook
call or by :meth:`SparcmlState.check`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm.engine import complete_future, device_future
from ..errors import RankMismatchError
from .config import resolved_or_noted, state_or_method
from .layout import reduce_ddp_bucket
from .methods import MethodConfig
from .peers import PeerState, pytorch_method, register_peer
from .reduce import Bucket, check_sparse_gradient_method
from .state import SparcmlState, checked_locally
from .stats import log_step

__all__ = [
    "HookState",
    "check_parameters",
    "check_settings",
    "check_sparse_gradients",
    "comm_hook",
    "register",
    "sparcml_hook",
    "sparse_gradient_parameters",
]


def sparcml_hook(
    state: SparcmlState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook running ``state.method`` on one ``GradBucket``.

    Register with ``ddp_model.register_comm_hook(state, sparcml_hook)`` (or
    :func:`register`). Returns a future of the averaged flat gradient.
    """
    params = bucket.parameters()
    index = bucket.index()
    names = tuple(state.name_of(p, i, index) for i, p in enumerate(params))
    sizes = tuple(p.numel() for p in params)
    flat = bucket.buffer()
    if sum(sizes) != flat.numel():
        raise RuntimeError(
            f"sparcml hook: bucket {index} holds {flat.numel()} gradient entries but its "
            f"parameters have {sum(sizes)}"
        )
    if state.hook_error is not None and state.hook_error_step < state.step:
        # an earlier backward's error that no backward has raised yet (its final
        # callback did not run). One of this backward's is raised at its end, on
        # every rank alike: raising it here, before this bucket's collective, would
        # depend on whether the engine had stored it yet, and leave the other ranks
        # waiting for this bucket
        state.check()
    item = Bucket(names, sizes, flat, state.step)
    last = bucket.is_last()
    if last:
        state.step += 1
    _arm_backward_check(state)
    # a future that may hold the bucket's device (a CUDA bucket in a CPU-only
    # future would fail to complete, and DDP would wait on it forever)
    fut: torch.futures.Future[torch.Tensor] = device_future(flat.device)

    def run() -> torch.Tensor:
        try:
            out = reduce_ddp_bucket(state, item, last)
            if last:
                log_step(state)  # the step is complete: its statistics
        except BaseException as e:
            state.comm.fail_call(e)
            if state.hook_error is None:
                state.hook_error, state.hook_error_step = e, item.step
            out = flat  # placeholder: backward raises the error before any step
        complete_future(fut, out, None)
        return out

    state.hook_works.append(state.comm.run_ordered(run, async_op=True))
    return fut


def _arm_backward_check(state: SparcmlState) -> None:
    """Once per backward: raise the hook's stored error at its end, on the training thread.

    The first final callback runs before DDP's (DDP queues its own when the last
    bucket is ready); it queues a second one, which runs after DDP has finished
    the reduction, so DDP's state stays consistent when backward raises.
    """
    if state.hook_armed:
        return
    engine = torch.autograd.Variable._execution_engine

    def after_ddp() -> None:
        state.hook_armed = False
        works, state.hook_works = state.hook_works, []
        for w in works:
            w.wait()
        state.check()

    try:
        engine.queue_callback(lambda: engine.queue_callback(after_ddp))
        state.hook_armed = True
    except RuntimeError:  # not inside backward: the next hook call or check() raises
        pass


# DDP checks the hook's annotations as objects; this module's are postponed strings.
sparcml_hook.__annotations__ = {
    "state": SparcmlState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _fingerprint(named: list[tuple[str, torch.Tensor]]) -> int:
    h = hashlib.sha256()
    for name, p in named:
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return int.from_bytes(h.digest()[:7], "little")


def check_settings(state: SparcmlState) -> None:
    """Check that every rank runs the same method with the same hyperparameters.

    A collective call (one small allgather of each rank's settings).

    Raises:
        RankMismatchError: on every rank, naming the ranks and settings that differ.
    """
    comm = state.comm
    if comm.world_size == 1:
        return
    mine = json.dumps(state.settings_dict(), sort_keys=True).encode()
    with comm.control():
        got = comm.allgatherv(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    table: list[dict[str, Any]] = []
    for r, buf in enumerate(got):
        try:
            table.append(json.loads(bytes(buf.cpu().numpy()).decode()))
        except ValueError:
            raise RankMismatchError(
                f"rank {r} sent unreadable settings: is it running the same sparcml version?"
            ) from None
    keys = sorted({k for row in table for k in row})
    diffs = []
    ranks: set[int] = set()
    for key in keys:
        values = [row.get(key) for row in table]
        if any(v != values[0] for v in values):
            odd = [r for r, v in enumerate(values) if v != values[0]]
            ranks.update(odd)
            shown = ", ".join(f"rank {r}: {values[r]!r}" for r in [0, *odd])
            diffs.append(f"{key} ({shown})")
    if diffs:
        raise RankMismatchError(
            f"ranks {sorted(ranks)} are configured differently from rank 0: "
            + "; ".join(diffs)
            + ". Every rank must build its SparcmlState with the same method and "
            "hyperparameters"
        )


def check_parameters(
    state: SparcmlState, named: list[tuple[str, torch.Tensor]], values: bool = False
) -> None:
    """Check that every rank registers the same parameters, in the same order.

    A collective call. Compares names, shapes and dtypes (and, with ``values``,
    a float64 checksum of the values) across the state's ranks.

    Raises:
        RankMismatchError: on every rank, naming the ranks that differ from rank 0.
    """
    comm = state.comm
    numel = sum(p.numel() for _, p in named)
    row = [_fingerprint(named), len(named), numel]
    if values:
        total = torch.zeros((), dtype=torch.float64)
        squares = torch.zeros((), dtype=torch.float64)
        for _, p in named:
            d = p.detach().to("cpu", torch.float64)
            total += d.sum()
            squares += (d * d).sum()
        row += [int(total.view(torch.int64)), int(squares.view(torch.int64))]
    rows = comm.allgather(torch.tensor(row, dtype=torch.int64))
    table = [r.tolist() for r in rows]
    differ = [r for r in range(comm.world_size) if table[r][:3] != table[0][:3]]
    if differ:
        detail = ", ".join(
            f"rank {r}: {table[r][1]} tensors / {table[r][2]} entries" for r in [0, *differ]
        )
        raise RankMismatchError(
            f"ranks {differ} register different parameters than rank 0 ({detail}; names, "
            "shapes or order differ): every rank must register the same model, "
            "parameters in the same order"
        )
    if values:
        differ = [r for r in range(comm.world_size) if table[r][3:] != table[0][3:]]
        if differ:
            raise RankMismatchError(
                f"parameter values differ across ranks: ranks {differ} differ from rank 0 "
                "(initialise with the same seed, or call "
                "sparcml.torch.broadcast_parameters(model, state) first)"
            )


def sparse_gradient_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters whose gradients are sparse COO tensors: the weights of
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with ``sparse=True`` (how
    DDP finds them too)."""
    if not isinstance(model, torch.nn.Module):
        return []
    out = []
    for prefix, module in model.named_modules():
        embedding = isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        if embedding and module.sparse and module.weight.requires_grad:
            out.append((f"{prefix}.weight" if prefix else "weight", module.weight))
    return out


def check_sparse_gradients(state: SparcmlState, model: Any) -> list[str]:
    """Refuse up front a method that cannot reduce a sparse-gradient parameter
    (``ValueError`` naming it); returns those parameters' names."""
    names = []
    for name, p in sparse_gradient_parameters(model):
        check_sparse_gradient_method(state, name, p.numel(), state.step)
        names.append(name)
    return names


def named_parameters_of(
    model: torch.nn.Module | Iterable[torch.Tensor], trainable_only: bool = True
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model, torch.nn.Module):
        return [
            (n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only
        ]
    params = list(model)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
    return [(f"param{i}", p) for i, p in enumerate(params) if p.requires_grad or not trainable_only]


def register(
    model: Any,
    method: str | MethodConfig | Mapping[str, Any] | os.PathLike[str] | None = None,
    state: SparcmlState | None = None,
    **hyper: Any,
) -> SparcmlState | PeerState:
    """Switch a DDP model's gradient allreduce to a sparcml method; returns the state.

    Args:
        model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        method: see :func:`sparcml.torch.methods` (ignored when ``state`` is given);
            or a config: a mapping, or a JSON/YAML file's path
            (:mod:`sparcml.torch.config`; keywords in ``hyper`` override it); or one
            of PyTorch's own baselines, run by PyTorch's code so that one call covers
            what users compare with: ``ddp`` (no hook) and ``powersgd`` /
            ``powersgdR`` (``powerSGD_hook`` of rank 2 / ``R``, with warm start and
            error feedback; ``warmup_steps=`` is its ``start_powerSGD_iter``). Those
            return a :class:`~sparcml.torch.peers.PeerState` (``step_bytes``,
            ``hook_state``: PyTorch's ``PowerSGDState``), not a ``SparcmlState``.
        state: a ready :class:`SparcmlState`; otherwise one is built from
            ``method`` and ``hyper`` (``density=``, ``warmup_steps=``, ...).

    Raises:
        TypeError: ``model`` is not DDP-wrapped (use :func:`sync_gradients`).
        RuntimeError: torch.distributed is not initialised.
        RankMismatchError: ranks register different parameters, or states with
            different methods or hyperparameters (raised on every rank, naming them).

    Example (under ``torchrun``)::

        model = DDP(model)
        state = sparcml.torch.register(model, method="topk", density=0.01)
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register() expects a DistributedDataParallel model, got {type(model).__name__}; "
            "for a plain model call sparcml.torch.sync_gradients(model, state) after backward"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("the DDP hook needs an initialised torch.distributed process group")
    built = state_or_method(method, state, hyper)
    if built is not None:
        name, options = built
        if isinstance(name, str) and pytorch_method(name):
            return register_peer(model, name, start_iter=_peer_warmup(name, options))
        state = SparcmlState(name, **options)
    assert state is not None
    if state.registered is not None:
        raise ValueError(f"this state is already registered with {state.registered}")
    if state.settings.clip_norm is not None and state.settings.clip_scope == "model":
        raise ValueError(
            "clip_scope='model' needs the whole gradient, which a DDP hook never sees "
            "(it gets one bucket at a time); use clip_scope='bucket' with DDP, or "
            "sync_gradients / DistributedOptimizer without DDP"
        )
    named = named_parameters_of(model.module)
    check_sparse_gradients(state, model.module)
    check_settings(state)
    check_parameters(state, named)
    state.set_parameters(named)
    state.registered = type(model.module).__name__
    model.register_comm_hook(state, sparcml_hook)
    return state


def _peer_warmup(method: str, options: Mapping[str, Any]) -> int:
    """PowerSGD's ``start_powerSGD_iter`` from ``warmup_steps``; PyTorch's baselines
    take no other option."""
    if method == "ddp":
        allowed, what = set(), "DDP allreduce, which takes no options"
    else:
        allowed, what = {"warmup_steps"}, "PowerSGD, which takes only warmup_steps"
    extra = sorted(set(options) - allowed)
    if extra:
        raise ValueError(f"{method!r} is PyTorch's own {what}; got {', '.join(extra)}")
    return int(options.get("warmup_steps", 0))


class HookState:
    """The ``state`` half of PyTorch's ``model.register_comm_hook(state, hook)``.

    Made by :func:`comm_hook`; holds the method and its options, and builds the
    :class:`SparcmlState` at the first bucket, when the process group exists
    (Lightning's ``DDPStrategy(ddp_comm_state=...)`` takes the state before it
    creates the group). Building it is a collective (a dedicated process group
    and the check that every rank runs the same method and hyperparameters),
    which every rank reaches at its first bucket. Bad options fail at once, here.
    Parameters are named ``param0``, ``param1``, ... in the order buckets first
    bring them (the hook never sees the model): layer rules by parameter name need
    :func:`register`.
    """

    def __init__(
        self, method: str | MethodConfig | Mapping[str, Any] = "topk", **options: Any
    ) -> None:
        # (a refusal is noted: the other ranks build their state at their first bucket
        # and find it there, naming this rank, instead of waiting for it)
        method, options = resolved_or_noted(method, options)
        checked_locally(method, options)
        self.method = method
        self.options = dict(options)
        self._state: SparcmlState | None = None
        #: a loaded checkpoint found to be another model's, raised after the last bucket
        self.refused_checkpoint: ValueError | None = None

    @property
    def state(self) -> SparcmlState:
        """The :class:`SparcmlState` (built on first use: a collective)."""
        if self._state is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "sparcml's comm hook needs an initialised torch.distributed process group"
                )
            state = SparcmlState(self.method, **self.options)
            check_settings(state)
            state.registered = "register_comm_hook"
            self._state = state
        return self._state

    @property
    def built(self) -> SparcmlState | None:
        """The :class:`SparcmlState` if a bucket has built it, else None (no collective:
        safe on one rank, e.g. to print statistics on rank 0 only; ``state`` builds it
        and must be reached by every rank)."""
        return self._state

    def state_dict(self) -> dict[str, Any]:
        """:meth:`SparcmlState.state_dict` (per rank; call between steps)."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """:meth:`SparcmlState.load_state_dict`."""
        self.state.load_state_dict(state_dict, strict)

    def __repr__(self) -> str:
        built = "built" if self._state is not None else "not built yet"
        return f"HookState(method={self.method!r}, options={self.options!r}, {built})"


def _comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch-convention hook of a :class:`HookState` (see :func:`comm_hook`).

    The hook never sees the model, so parameters are named ``param0``, ``param1``,
    ... in the order buckets first bring them (the same on every rank): stable
    names for the residuals when DDP rebuilds its buckets after the first step.
    Their shapes are recorded as met (checkpoints carry them), and a checkpoint
    loaded before the first step is checked against them: each parameter when a
    bucket first brings it, before that bucket is reduced with the checkpoint's
    residuals, and their count after the first step's last bucket. On a checkpoint
    of another model the state forgets what it loaded (residuals, momenta) before
    that bucket, every bucket is still reduced (no rank waits on this one), and
    backward raises ``ValueError`` at its end, before any optimizer step."""
    inner = state.state
    names = inner.param_names
    expected = inner.checkpoint_parameters
    for p in bucket.parameters():
        if id(p) not in names:
            names[id(p)] = name = f"param{len(names)}"
            inner.param_shapes[name] = tuple(p.shape)
            names.in_bucket_order = True
            if expected is not None and tuple(expected.get(name, ())) != tuple(p.shape):
                saved = tuple(expected[name]) if name in expected else "not there"
                state.refused_checkpoint = ValueError(
                    f"sparcml checkpoint of other parameters ({name}: {saved} in the "
                    f"checkpoint, {tuple(p.shape)} here): it belongs to another model; "
                    "what it held was dropped. load_state_dict(..., strict=False) skips "
                    "this check"
                )
                inner.checkpoint_parameters = expected = None
                inner.comm.run_ordered(inner.reset, async_op=True)  # before this bucket
    fut = sparcml_hook(inner, bucket)
    if bucket.is_last():
        if expected is not None:
            try:
                inner.check_checkpoint_parameters()  # the count, once all were met
            except ValueError as e:
                state.refused_checkpoint = e
        if state.refused_checkpoint is not None:
            # (at the last bucket: an error stored earlier would be raised by the next
            # bucket's hook, before its collective, leaving the other ranks waiting)
            if inner.hook_error is None:
                inner.hook_error = state.refused_checkpoint
                inner.hook_error_step = inner.step - 1  # this backward's
            state.refused_checkpoint = None
    return fut


_comm_hook.__annotations__ = {  # as sparcml_hook's: DDP checks them as objects
    "state": HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def comm_hook(
    method: str | MethodConfig | Mapping[str, Any] | os.PathLike[str] = "topk", **options: Any
) -> tuple[HookState, Any]:
    """``(state, hook)`` for PyTorch's ``model.register_comm_hook(state, hook)``.

    The same method (or config) and options as :func:`register` (``density=``,
    ``momentum=``, ...), for code written for PyTorch's own hooks and for frameworks that take
    them, e.g. Lightning::

        state, hook = sparcml.torch.comm_hook("topk", density=0.01)
        ddp_model.register_comm_hook(state, hook)
        # or: DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)

    ``state.state`` is the :class:`SparcmlState` (statistics, checkpoints), built
    at the first bucket.

    Raises:
        ValueError: an unknown method or a bad option (at once, on this rank).
    """
    return HookState(method, **options), _comm_hook
