"""The pipeline's settings: what every method's steps 1-7 share, frozen and checked once.

Grouped as PyTorch's ``PowerSGDState`` groups its arguments: these are the
hyperparameters and switches of the pipeline (:mod:`sparcml.torch.reduce`); the
method's own hyperparameters are its typed config (:mod:`sparcml.torch.methods`);
residuals, momenta and counters are runtime (:mod:`sparcml.torch.runtime`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["NAN_POLICIES", "RESIDUAL_PRECISIONS", "PipelineSettings"]

RESIDUAL_PRECISIONS = ("float32", "gradient")
NAN_POLICIES = ("propagate", "raise", "unchecked")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """Settings of the per-group pipeline (every field checked at construction).

    Attributes:
        error_feedback: keep what was not sent and add it to the next gradient.
            None (default): on for methods that select (they are biased), off for
            those that send every entry (unbiased quantizers need none).
        warmup_steps: the first steps synchronise densely (RedSync sec. 3.5; DGC).
        momentum: DGC momentum correction (paper 002 sec. 3.5): accumulate
            ``u = m u + g; v = v + u`` locally and send from ``v``. Use a plain SGD
            optimizer (no momentum) with it. 0 disables it.
        momentum_masking: DGC momentum factor masking (DGC sec. 3.2): zero ``u``
            where ``v`` was sent. Off by default, unlike DGC: at density 1 it
            clears the momentum every step (SGD without momentum), and off it
            reached the target in fewer steps on the recipes measured
            (docs/training.md, "Steps to target").
        clip_norm: DGC/RedSync local gradient clipping to ``clip_norm / sqrt(P)``
            before accumulating (per bucket, or per model: ``clip_scope``).
        clip_scope: ``"bucket"`` (default; the DDP hook sees one bucket at a time)
            or ``"model"``: RedSync's sec. 3.5 clipping of the whole local gradient
            (:func:`~sparcml.torch.sync_gradients` and ``DistributedOptimizer``).
        nan_policy: ``"propagate"`` (NaN/Inf travel as in a dense allreduce) or
            ``"raise"``: all ranks raise the same :class:`FloatingPointError` naming
            the ranks and parameters (one tiny allreduce per bucket), or
            ``"unchecked"``: no check and no round of its own; NaN/Inf go where the
            method takes them (a selector picks them first, a residual may keep
            them): the one-tensor SGD steps' setting, as in the papers.
        residual_precision: ``"float32"`` (default: with 16-bit gradients,
            residuals and momenta in float32) or ``"gradient"`` (in the gradient's
            dtype: half the memory, small residual entries lost to rounding).
        bucket_bytes: bucket size of :func:`~sparcml.torch.sync_gradients`.
        seed: seed of random selectors and quantizers (ranks agree where they must).
        stats_every: log the group statistics every this many steps (logger
            ``sparcml.stats``, INFO); 0: never.
        stats_ranks: ``"first"`` (rank 0 logs) or ``"all"``.
    """

    error_feedback: bool | None = None
    warmup_steps: int = 0
    momentum: float = 0.0
    momentum_masking: bool = False
    clip_norm: float | None = None
    clip_scope: str = "bucket"
    nan_policy: str = "propagate"
    residual_precision: str = "float32"
    bucket_bytes: int = 25 * 1024 * 1024
    seed: int = 0
    stats_every: int = 0
    stats_ranks: str = "first"

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "bucket_bytes", "seed", "stats_every"):
            value = getattr(self, name)
            try:
                whole = not isinstance(value, bool) and float(value).is_integer()
            except (TypeError, ValueError):
                whole = False
            if not whole:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # (numpy integers, 5.0)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        if self.clip_scope not in ("bucket", "model"):
            raise ValueError(f"clip_scope must be 'bucket' or 'model', got {self.clip_scope!r}")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(
                f"nan_policy must be one of {', '.join(map(repr, NAN_POLICIES))}, "
                f"got {self.nan_policy!r}"
            )
        if self.residual_precision not in RESIDUAL_PRECISIONS:
            raise ValueError(
                f"residual_precision must be one of {RESIDUAL_PRECISIONS}, "
                f"got {self.residual_precision!r}"
            )
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.stats_every < 0:
            raise ValueError(
                f"stats_every must be a non-negative integer, got {self.stats_every!r}"
            )
        if self.stats_ranks not in ("first", "all"):
            raise ValueError(f"stats_ranks must be 'first' or 'all', got {self.stats_ranks!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names (the keyword arguments of the string form)."""
        return tuple(f.name for f in dataclasses.fields(cls))
