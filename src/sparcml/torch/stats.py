"""Compression statistics from a state, and periodic logging of them (like PowerSGD's).

Call after the optimizer step::

    sparcml.torch.stats.log_every(state, 100)   # logs at INFO every 100 steps

The figures are this rank's: bytes it sent for gradients (last step, mean per step),
the ratio to a dense allreduce's bytes (when ``dense_bytes`` is given: a ring
allreduce sends ``2 (P-1)/P x 4 N`` bytes per rank for ``N`` float32 entries), and
the L2 norm of the error-feedback residuals (what has not been sent yet).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

__all__ = ["compression_stats", "log_every"]

log = logging.getLogger("sparcml.stats")


def compression_stats(state: Any, dense_bytes: float | None = None) -> dict[str, float]:
    """``step``, ``bytes_last_step``, ``bytes_per_step``, ``residual_norm`` and, with
    ``dense_bytes`` (per step), ``ratio`` (dense bytes / bytes per step)."""
    steps = len(state.step_bytes)
    per_step = state.bytes_sent / steps if steps else 0.0
    squares = sum(
        float(torch.linalg.vector_norm(r.detach(), dtype=torch.float64)) ** 2
        for r in state.residuals.values()
    )
    out = {
        "step": float(state.step),
        "bytes_last_step": float(state.step_bytes[-1]) if steps else 0.0,
        "bytes_per_step": per_step,
        "residual_norm": math.sqrt(squares),
    }
    if dense_bytes is not None and per_step:
        out["ratio"] = dense_bytes / per_step
    return out


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
