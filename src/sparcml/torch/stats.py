"""Compression statistics from a state, and periodic logging of them (like PowerSGD's).

Per parameter group (the state's own method, and one group per layer rule),
:class:`GroupStats` counts per step: the bytes this rank sent, the bytes a dense
ring allreduce of the same entries would have sent (``2 (P-1)/P`` of them), the
entries selected against the ``k`` the density asks for, and the time split into
*compress* (local gradient clipping, accumulation with the residual and the
selector: the work before the collective) and *communicate* (the collective,
including its encoding, merging and any quantization inside it, and the
residual update). ``state.group_stats()`` returns them;
``SparcmlState(stats_every=N)`` logs them every ``N`` steps (logger
``sparcml.stats``, INFO), or call::

    sparcml.torch.stats.log_every(state, 100)   # after the optimizer step

The figures are this rank's: bytes it sent for gradients (last step, mean per step),
the ratio to a dense allreduce's bytes (when ``dense_bytes`` is given: a ring
allreduce sends ``2 (P-1)/P x 4 N`` bytes per rank for ``N`` float32 entries), and
the L2 norm of the error-feedback residuals (what has not been sent yet).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

__all__ = [
    "GroupStats",
    "compression_stats",
    "log_every",
    "log_groups",
    "log_step",
    "residual_norm",
]

log = logging.getLogger("sparcml.stats")


@dataclasses.dataclass
class GroupStats:
    """One parameter group's counters (this rank's): totals and the last step's."""

    label: str
    method: str
    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    numel: int = 0
    last_step: int = -1
    last_bytes: int = 0
    last_selected: int | None = None
    last_k: int | None = None
    last_compress_s: float = 0.0
    last_communicate_s: float = 0.0
    residual_norm: float = 0.0  # L2 norm of the group's residuals (when last asked)

    def record(
        self,
        step: int,
        numel: int,
        sent_bytes: int,
        dense_bytes: float,
        compress_s: float,
        communicate_s: float,
        selected: int | None,
        k: int | None,
    ) -> None:
        """Add one bucket's figures (several buckets of a step add up)."""
        if step != self.last_step:
            self.steps += 1
            self.last_step = step
            self.numel = self.last_bytes = 0
            self.last_selected = self.last_k = None
            self.last_compress_s = self.last_communicate_s = 0.0
        self.numel += numel
        self.bytes_sent += sent_bytes
        self.last_bytes += sent_bytes
        self.dense_bytes += round(dense_bytes)
        self.compress_s += compress_s
        self.communicate_s += communicate_s
        self.last_compress_s += compress_s
        self.last_communicate_s += communicate_s
        if selected is not None:
            self.last_selected = (self.last_selected or 0) + selected
            self.last_k = (self.last_k or 0) + (k or 0)

    @property
    def ratio(self) -> float:
        """Dense ring-allreduce bytes / bytes sent (inf when nothing was sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def compression_stats(state: Any, dense_bytes: float | None = None) -> dict[str, float]:
    """``step``, ``bytes_last_step``, ``bytes_per_step``, ``residual_norm`` and, with
    ``dense_bytes`` (per step), ``ratio`` (dense bytes / bytes per step)."""
    steps = len(state.step_bytes)
    per_step = state.bytes_sent / steps if steps else 0.0
    squares = sum(residual_norm(g.feedback.buffers) ** 2 for g in state.groups)
    out = {
        "step": float(state.step),
        "bytes_last_step": float(state.step_bytes[-1]) if steps else 0.0,
        "bytes_per_step": per_step,
        "residual_norm": math.sqrt(squares),
    }
    if dense_bytes is not None and per_step:
        out["ratio"] = dense_bytes / per_step
    return out


def residual_norm(residuals: dict[str, torch.Tensor]) -> float:
    """The L2 norm of a group's error-feedback residuals (float64)."""
    return math.sqrt(
        sum(
            float(torch.linalg.vector_norm(r.detach(), dtype=torch.float64)) ** 2
            for r in residuals.values()
        )
    )


def log_every(state: Any, every: int, dense_bytes: float | None = None) -> bool:
    """Log :func:`compression_stats` through ``logging`` when ``state.step`` is a
    multiple of ``every``; returns whether it logged."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if state.step == 0 or state.step % every:
        return False
    s = compression_stats(state, dense_bytes)
    ratio = f", {s['ratio']:.1f}x fewer bytes than dense" if "ratio" in s else ""
    log.info(
        "sparcml %s step %d: %.0f bytes last step, %.0f per step%s, residual norm %.4g",
        state.method, state.step, s["bytes_last_step"], s["bytes_per_step"], ratio,
        s["residual_norm"],
    )  # fmt: skip
    return True


def log_step(state: Any) -> None:
    """After a step: ``state.settings.stats_every``'s line per group, on rank 0 (every rank
    with ``stats_ranks="all"``). Every entry point calls it once per step."""
    every = state.settings.stats_every
    if not every or state.step % every:
        return
    if state.settings.stats_ranks == "first" and state.comm.rank != 0:
        return
    log_groups(state)


def log_groups(state: Any) -> None:
    """Log one line per parameter group of ``state`` (``state.group_stats()``)."""
    for g in state.group_stats().values():
        if not g.steps:
            continue
        sel = f", selected {g.last_selected}/{g.last_k}" if g.last_selected is not None else ""
        log.info(
            "sparcml step %d [%s: %s, %d entries]: %d bytes (%.1fx fewer than dense)%s, "
            "residual norm %.4g, compress %.2f ms, communicate %.2f ms",
            g.last_step, g.label, g.method, g.numel, g.last_bytes, g.ratio, sel,
            g.residual_norm, g.last_compress_s * 1e3, g.last_communicate_s * 1e3,
        )  # fmt: skip
