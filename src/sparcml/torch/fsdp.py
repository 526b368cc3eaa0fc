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
with error feedback and quantization, is beyond the paper.

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
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import split_and_reduce
from ..collectives.codec import EXACT, StreamCodec
from ..compress.base import Composed, Quantizer, Selector
from ..stream import SparseStream
from .config import resolve_method
from .state import SparcmlState
from .stats import log_step

__all__ = ["FSDP_METHODS", "SparcmlReduceScatter", "register_fsdp"]

log = logging.getLogger(__name__)

#: state kinds the FSDP reduce-scatter runs
FSDP_METHODS = ("dense", "nonzeros", "quantized", "sparse")


def _base_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class SparcmlReduceScatter:  # made a ReduceScatter subclass in register_fsdp
    """FSDP2 custom reduce-scatter running ``state.method`` on one module's gradient."""

    def __init__(self, state: SparcmlState, name: str, expected: int) -> None:
        self.state = state
        self.name = name
        self.expected = expected  # modules that reduce-scatter per step

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
        step = self._count_step()
        before = comm.stats.bytes_sent
        try:
            total = comm.run_ordered(lambda: self._reduce(input_tensor, width, step), True).wait()
        finally:
            sent = comm.stats.bytes_sent - before
            state.bytes_sent += sent
            while len(state.step_bytes) <= step:
                state.step_bytes.append(0)
            state.step_bytes[step] += sent
        output_tensor.copy_(_apply_op(total, op, p).to(output_tensor.dtype))
        if state.step > step:  # this module's reduce-scatter completed the step
            log_step(state)
        return None

    def _count_step(self) -> int:
        """The step this call belongs to: a step ends when every module with
        gradients has reduce-scattered once (or when a module comes back)."""
        state = self.state
        pending: set[str] = state.__dict__.setdefault("_fsdp_pending", set())
        if self.name in pending:  # a module skipped the last step (no gradient)
            state.step += 1
            pending.clear()
        step = state.step
        pending.add(self.name)
        if len(pending) >= self.expected:
            state.step += 1
            pending.clear()
        return step

    def _reduce(self, grad: torch.Tensor, width: int, step: int) -> torch.Tensor:
        """This rank's chunk of the sum over ranks (float32 or wider)."""
        state = self.state
        comm = state.comm
        t0 = time.perf_counter()
        before = comm.stats.bytes_sent
        elem = grad.element_size()
        g = grad.detach().reshape(-1)
        if g.dtype in (torch.float16, torch.bfloat16):
            g = g.float()
        bounds = [j * width for j in range(comm.world_size + 1)]
        state.at_step(step)  # density schedules
        kind = "dense" if step < state.warmup_steps else state.kind
        codec: StreamCodec = EXACT
        if kind == "dense":
            stream = SparseStream.dense(g)
        elif kind == "nonzeros":
            stream = SparseStream.from_dense(g)
        elif kind == "quantized":
            op = state.operator(("fsdp", self.name))
            assert isinstance(op, Quantizer)
            codec = StreamCodec(
                op, "contributions", index_coding=getattr(state.config, "index_coding", "fixed")
            )
            stream = SparseStream.dense(g)
        else:  # sparse, with error feedback
            op = state.operator(("fsdp", self.name))
            selector: Selector = op.selector if isinstance(op, Composed) else op
            if isinstance(op, Composed):
                codec = StreamCodec(
                    op.quantizer,
                    "contributions",
                    index_coding=getattr(state.config, "index_coding", "fixed"),
                )
            r = state.residuals.get(self.name)
            acc = g + r if state.error_feedback and r is not None and r.numel() == g.numel() else g
            stream = selector.select(acc)
            if state.error_feedback:
                res = acc.clone()
                if stream.is_dense:
                    res.zero_()
                elif stream.nnz:
                    res[stream.indices] -= stream.values
                state.residuals[self.name] = res
        if codec is not EXACT:
            codec = codec.with_call(comm.next_sequence(), comm.rank)
        compress_s = time.perf_counter() - t0  # selection, residual (the local part)
        mine, _, _ = split_and_reduce(stream, comm, codec, bounds)
        out = mine.to_dense()
        p, n = comm.world_size, g.numel()
        sparse = kind == "sparse" and not stream.is_dense
        state.stats.record(
            step,
            n,
            comm.stats.bytes_sent - before,
            (p - 1) / p * n * elem,  # a ring reduce-scatter of the gradient as it came
            compress_s,
            max(0.0, time.perf_counter() - t0 - compress_s),
            stream.nnz if sparse else None,
            max(1, round(state.density * n)) if sparse and n else None,
        )
        return out


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


def register_fsdp(
    model: torch.nn.Module,
    method: str | Mapping[str, Any] | os.PathLike[str] = "topk",
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
            ``natural_ina``; momentum correction, clipping, ``nan_policy="raise"``).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"register_fsdp() expects the root module after fully_shard(model), got "
            f"{type(model).__name__}"
        )
    if state is None:
        name, options = resolve_method(method, hyper)
        state = SparcmlState(name, **options)
    elif hyper or method != "topk":
        raise ValueError("give either a state or method/hyperparameters, not both")
    if state.kind not in FSDP_METHODS:
        raise ValueError(
            f"method {state.method!r} has no FSDP reduce-scatter; use dense, nonzeros, "
            "a quantizer (natural, qsgd, dithering) or a selector (topk, topk+natural)"
        )
    if state.momentum or state.clip_norm is not None or state.nan_policy != "propagate":
        raise ValueError(
            "register_fsdp supports neither momentum correction, clip_norm nor "
            "nan_policy='raise' (use the optimizer's momentum and torch's clipping)"
        )
    if state.rules:
        raise ValueError(
            "register_fsdp does not support layer rules (layers=, dense_below=): FSDP "
            "reduce-scatters each module's parameters as one flat tensor; use one method "
            "for the model, or DDP / sync_gradients for per-layer rules"
        )
    if state.registered is not None:
        raise ValueError(f"this state is already registered with {state.registered}")
    cls = type("SparcmlFsdpReduceScatter", (SparcmlReduceScatter, _base_class()), {})
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    expected = sum(1 for _, m in modules if _has_grads(m))
    for name, module in modules:
        module.set_custom_reduce_scatter(cls(state, name or "<root>", max(1, expected)))
    count = len(modules)
    state.registered = f"fsdp:{type(model).__name__}"
    log.info("sparcml: %s reduce-scatter on %d fully_shard modules", state.method, count)
    return state
