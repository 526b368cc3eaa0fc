"""sparcml for PyTorch training: a DDP communication hook and an explicit sync API.

With DDP (three lines)::

    import sparcml.torch
    model = DDP(model)
    state = sparcml.torch.register(model, method="topk", density=0.01)

Without DDP (any transport, MPI included)::

    state = sparcml.torch.SparcmlState("oktopk", density=0.01)
    loss.backward(); sparcml.torch.sync_gradients(model, state); optimizer.step()

With FSDP2 (after ``fully_shard``): ``sparcml.torch.register_fsdp(model, method="topk")``
(:mod:`sparcml.torch.fsdp`). Checkpoints: ``state.state_dict()`` per rank
(:mod:`sparcml.torch.checkpoint`).

Methods: :func:`methods`. Hyperparameters: :class:`SparcmlState`, or a config (a
mapping, JSON or YAML file) wherever a method name goes (:mod:`sparcml.torch.config`).
Per-layer rules
and density schedules: :class:`LayerRule`, :class:`DensityWarmup`
(:mod:`sparcml.torch.rules`). Statistics: ``state.group_stats()``
(:mod:`sparcml.torch.stats`).
"""

from __future__ import annotations

from .config import load_config
from .fsdp import register_fsdp
from .hook import HookState, check_parameters, comm_hook, register, sparcml_hook
from .reduce import Bucket, reduce_bucket
from .rules import DensityWarmup, LayerRule, StepRange
from .state import SparcmlState, methods, needs_momentum_correction
from .stats import GroupStats
from .sync import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    sync_gradients,
)

__all__ = [
    "Bucket",
    "DensityWarmup",
    "DistributedOptimizer",
    "GroupStats",
    "HookState",
    "LayerRule",
    "SparcmlState",
    "StepRange",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_parameters",
    "comm_hook",
    "load_config",
    "methods",
    "needs_momentum_correction",
    "reduce_bucket",
    "register",
    "register_fsdp",
    "sparcml_hook",
    "sync_gradients",
]
