"""sparcml for PyTorch training: a DDP communication hook and an explicit sync API.

With DDP (three lines)::

    import sparcml.torch
    model = DDP(model)
    state = sparcml.torch.register(model, method="topk", density=0.01)

A method is a name with keyword options, or a typed config passed whole::

    sparcml.torch.register(model, sparcml.torch.OkTopk(density=0.01, tau=64), momentum=0.9)

Without DDP (any transport, MPI included)::

    state = sparcml.torch.SparcmlState("oktopk", density=0.01)
    loss.backward(); sparcml.torch.sync_gradients(model, state); optimizer.step()

With FSDP2 (after ``fully_shard``): ``sparcml.torch.register_fsdp(model, method="topk")``.
For PyTorch's ``register_comm_hook`` and frameworks that take a ``(state, hook)``
pair: :func:`comm_hook`.

Methods: :func:`methods` and :mod:`sparcml.torch.methods` (every typed config:
``TopK``, ``OkTopk``, ``RedSync``, ``Quantized``, ``Nonzeros``, ``NaturalIna``,
``Dense``, ``Fp16``, ``Bf16``). Pipeline settings: :class:`PipelineSettings`.
Per-layer rules and density schedules: :class:`LayerRule`, :class:`DensityWarmup`
(:mod:`sparcml.torch.rules`). Configs as data: :mod:`sparcml.torch.config`.
Checkpoints: ``state.state_dict()`` per rank (:mod:`sparcml.torch.checkpoint`).
Statistics: ``state.group_stats()`` (:mod:`sparcml.torch.stats`).
"""

from __future__ import annotations

from .fsdp import register_fsdp
from .hook import comm_hook, register
from .methods import (
    Bf16,
    Dense,
    Fp16,
    NaturalIna,
    Nonzeros,
    OkTopk,
    Quantized,
    RedSync,
    TopK,
    methods,
)
from .rules import DensityWarmup, LayerRule
from .settings import PipelineSettings
from .state import SparcmlState, needs_momentum_correction
from .steps import oktopk_sgd_step, topk_sgd_step
from .sync import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    sync_gradients,
)

__all__ = [
    "Bf16",
    "Dense",
    "DensityWarmup",
    "DistributedOptimizer",
    "Fp16",
    "LayerRule",
    "NaturalIna",
    "Nonzeros",
    "OkTopk",
    "PipelineSettings",
    "Quantized",
    "RedSync",
    "SparcmlState",
    "TopK",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
    "methods",
    "needs_momentum_correction",
    "oktopk_sgd_step",
    "register",
    "register_fsdp",
    "sync_gradients",
    "topk_sgd_step",
]
