"""Compressed reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

Usage (every rank, after ``fully_shard`` on the layers and the root)::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = sparcml.torch.register_fsdp(model, method="topk", density=0.01)

FSDP2 reduce-scatters each ``fully_shard`` module's flat gradient (its parameters'
gradients, each padded to a multiple of ``P`` along dim 0 and laid out as ``P``
contiguous chunks, chunk ``r`` being rank ``r``'s shard). ``register_fsdp`` installs a
:class:`SparcmlReduceScatter` on every such module through
``FSDPModule.set_custom_reduce_scatter``: it receives that flat input and this
rank's output shard.

SparCML's split phase *is* a sparse reduce-scatter (paper 000, sec. 5.3.2: "split the
index space into ``P`` ranges, send range ``j`` to rank ``j``, which sums them"), so
every method runs :func:`~sparcml.collectives.split_and_reduce` with FSDP's
chunk boundaries and the library's codec (:mod:`sparcml.collectives.codec`): rank
``j`` sums the ``P`` pieces of its chunk in rank order. The paper follows the split
with an allgather to make an allreduce; FSDP stops after the split (its next forward
all-gathers parameters, not gradients) — using the split alone as a reduce-scatter,
with error feedback and quantization, is beyond the paper. On ranks that span several
nodes of several ranks (:attr:`~sparcml.comm.Communicator.topology`), the split runs in
two levels (:func:`~sparcml.collectives.reduce_scatter`: inside the node, then between
nodes), so each node's NIC carries the node's sum once.

Methods:

- ``dense``: the reference; the dense chunks through the split (sum in rank order).
- ``nonzeros``: lossless; each chunk's non-zeros as a sparse message (paper 000, sec.
  8.2: naturally sparse gradients). Equals plain FSDP up to the order of the sum.
- ``natural``, ``qsgd``, ``dithering``, ``natural_dithering``: unbiased quantization
  (paper 004: ``C_nat`` sec. 3, natural dithering sec. 4): every rank quantizes each
  piece it sends once (``quantize="contributions"``), the owner decodes the ``P``
  pieces and sums them in rank order. No extra memory.
- ``topk``, ``topk+natural`` (any selector, optionally ``+quantizer``): SparCML's TopK
  SGD (paper 000, Alg. 1) on the module's whole flat gradient with error feedback:
  ``acc = residual + g``, send ``TopK(acc)`` split by owner (quantized with
  ``+natural``), keep ``residual = acc - TopK(acc)``.

Memory: the error-feedback residual has the size of the module's *unsharded* (padded)
gradient on every rank, in float32 (or the gradient's dtype if wider): for a model of
``N`` parameters, ``4 N`` bytes per rank — what FSDP saves by sharding the gradient
comes back for top-k methods. Quantized and lossless methods keep no residual.

The op FSDP asks for is respected: ``SUM``, ``AVG`` (sum / ``P``) and
``PREMUL_SUM(1/f)`` (``set_gradient_divide_factor(f)``: sum / ``f``); FSDP applies its
own pre- and post-division factors (fp16 reductions) around the call. A
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 / float16)`` is handled: the
compression runs in float32 and the shard is cast back to the reduce dtype.
HSDP (a 2-D mesh) is refused: the reduce-scatter group must be the whole world.

Each rank writes only its own shard, so the unsharded parameters FSDP all-gathers are
bitwise identical on every rank by construction.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .config import state_or_method
from .hook import check_settings
from .methods import MethodConfig
from .reduce import Bucket, count_bytes, reduce_group
from .state import SparcmlState, checked_locally
from .stats import log_step

__all__ = ["SparcmlReduceScatter", "register_fsdp"]

log = logging.getLogger(__name__)


def _base_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class StepCounter:
    """The step a module's reduce-scatter belongs to: a step ends when every module
    with gradients has reduce-scattered once (or when a module comes back)."""

    def __init__(self, state: SparcmlState, expected: int) -> None:
        self.state = state
        self.expected = expected
        self.pending: set[str] = set()

    def step_of(self, name: str) -> int:
        state = self.state
        if name in self.pending:  # a module skipped the last step (no gradient)
            state.step += 1
            self.pending.clear()
        step = state.step
        self.pending.add(name)
        if len(self.pending) >= self.expected:
            state.step += 1
            self.pending.clear()
        return step


class SparcmlReduceScatter:  # made a ReduceScatter subclass in register_fsdp
    """FSDP2 custom reduce-scatter: one module's flat gradient through the pipeline
    (:func:`~sparcml.torch.reduce.reduce_group` with FSDP's chunk boundaries)."""

    def __init__(self, state: SparcmlState, name: str, steps: StepCounter) -> None:
        self.state = state
        self.name = name
        self.steps = steps

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        state = self.state
        comm = state.comm
        p = comm.world_size
        if group.size() != p or dist.get_rank(group) != comm.rank:
            raise RuntimeError(
                f"sparcml FSDP: the reduce-scatter group has {group.size()} ranks, the "
                f"sparcml state {p}: only 1-D FSDP over the whole world is supported (not HSDP)"
            )
        n, width = input_tensor.numel(), output_tensor.numel()
        if n != width * p:
            raise RuntimeError(f"sparcml FSDP: input {n} entries is not {p} x output {width}")
        step = self.steps.step_of(self.name)
        before = comm.stats.bytes_sent
        try:
            total = comm.run_ordered(lambda: self._reduce(input_tensor, width, step), True).wait()
        finally:
            count_bytes(state, step, comm.stats.bytes_sent - before)
        output_tensor.copy_(_apply_op(total, op, p).to(output_tensor.dtype))
        if state.step > step:  # this module's reduce-scatter completed the step
            log_step(state)
        return None

    def _reduce(self, grad: torch.Tensor, width: int, step: int) -> torch.Tensor:
        """This rank's chunk of the sum over ranks (float32 or wider)."""
        state = self.state
        g = grad.detach().reshape(-1)
        if g.dtype in (torch.float16, torch.bfloat16):
            g = g.float()  # compressed in float32, the shard cast back by the caller
        bounds = [j * width for j in range(state.comm.world_size + 1)]
        state.at_step(step)
        bucket = Bucket(
            (self.name,), (g.numel(),), g, step, op_key=("fsdp", self.name),
            itemsize=grad.element_size(),
        )  # fmt: skip
        return reduce_group(state.groups[0], bucket, bounds)


def _apply_op(total: torch.Tensor, op: Any, p: int) -> torch.Tensor:
    """``SUM`` as is, ``AVG`` divided by ``P``, ``PREMUL_SUM(c)`` times ``c``."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return total
    if kind == dist.ReduceOp.AVG:
        return total / p
    if kind == dist.ReduceOp.PREMUL_SUM:
        return total * float(op.factor)
    raise ValueError(f"sparcml FSDP: reduce op {op} is not supported (SUM, AVG, PREMUL_SUM)")


def _has_grads(module: Any) -> bool:
    """Whether a ``fully_shard`` module's own parameter group has trainable parameters."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and any(p.sharded_param.requires_grad for p in group.fsdp_params)


def _check_fsdp(state: SparcmlState) -> None:
    """Refuse what FSDP2's reduce-scatter cannot run (ValueError naming it)."""
    if state.groups[0].spec.scatter is None:
        raise ValueError(
            f"method {state.method!r} has no FSDP reduce-scatter; use dense, nonzeros, "
            "a quantizer (natural, qsgd, dithering) or a selector (topk, topk+natural)"
        )
    settings = state.settings
    if settings.momentum or settings.clip_norm is not None or settings.nan_policy != "propagate":
        raise ValueError(
            "register_fsdp supports neither momentum correction, clip_norm nor a "
            f"nan_policy other than 'propagate' (got {settings.nan_policy!r}; use the "
            "optimizer's momentum and torch's clipping)"
        )
    if state.rules:
        raise ValueError(
            "register_fsdp does not support layer rules (layers=, dense_below=): FSDP "
            "reduce-scatters each module's parameters as one flat tensor; use one method "
            "for the model, or DDP / sync_gradients for per-layer rules"
        )


def register_fsdp(
    model: torch.nn.Module,
    method: str | MethodConfig | Mapping[str, Any] | os.PathLike[str] | None = None,
    state: SparcmlState | None = None,
    **hyper: Any,
) -> SparcmlState:
    """Install sparcml's compressed reduce-scatter on every ``fully_shard`` module.

    Args:
        model: the root module, with ``fully_shard`` applied to it (and usually to its
            layers first); every ``FSDPModule`` inside gets its own reduce-scatter.
        method: ``dense``, ``nonzeros``, a quantizer (``natural``, ``qsgd``,
            ``dithering``, ``natural_dithering``), a selector (``topk``, ...) or a
            ``selector+quantizer`` (``topk+natural``); see the module docstring.
            Or a config: a mapping or a JSON/YAML file (:mod:`sparcml.torch.config`).
        state: a ready :class:`SparcmlState`; otherwise built from ``method`` and
            ``hyper`` (``density=``, ``compressor_params=``, ``seed=``, ...).

    Returns:
        The state: residuals per module (by module name), counters, and
        ``state_dict()`` / ``load_state_dict()`` for checkpoints (per rank).

    Raises:
        TypeError: ``model`` is not an ``FSDPModule``.
        ValueError: a method or option FSDP cannot run (``oktopk``, ``redsync``,
            ``natural_ina``; momentum correction, clipping, a ``nan_policy`` other
            than ``"propagate"``).
        RankMismatchError: ranks register different methods or hyperparameters, or
            another rank refused its own (raised on every rank, naming them).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"register_fsdp() expects the root module after fully_shard(model), got "
            f"{type(model).__name__}"
        )
    built = state_or_method(method, state, hyper)
    if built is not None:
        name, options = built
        checked_locally(name, options, _check_fsdp)  # before the state's process group
        state = SparcmlState(name, **options)
    assert state is not None
    check_settings(state)  # every rank the same method and hyperparameters (a collective)
    _check_fsdp(state)  # (a ready state: after the comparison, so every rank raises alike)
    if state.registered is not None:
        raise ValueError(f"this state is already registered with {state.registered}")
    cls = type("SparcmlFsdpReduceScatter", (SparcmlReduceScatter, _base_class()), {})
    # one reduce-scatter per parameter group: fully_shard([a, b]) gives two modules
    # one FSDP state (counted twice, the step counter never closed a step, and the
    # second hook replaced the first)
    groups: dict[int, tuple[str, Any]] = {}
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            groups.setdefault(id(m._get_fsdp_state()), (n, m))
    modules = list(groups.values())
    expected = sum(1 for _, m in modules if _has_grads(m))
    steps = StepCounter(state, max(1, expected))
    for name, module in modules:
        module.set_custom_reduce_scatter(cls(state, name or "<root>", steps))
    count = len(modules)
    state.registered = f"fsdp:{type(model).__name__}"
    log.info("sparcml: %s reduce-scatter on %d fully_shard modules", state.method, count)
    return state
