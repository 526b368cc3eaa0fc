"""Throughput of every compression operator next to a plain copy, measured in one run.

For each tensor size (default 4 MB and 64 MB of float32 Gaussian values) the
benchmark times ``tensor.clone()`` (the copy baseline: reads the input and
writes a new tensor, as an operator does) and ``compress`` of every operator,
each after a warm-up, as the median of ``repeats`` runs; throughput is input
bytes per second. Ratios are taken within the same run. Selectors run at
density 0.1% (RedSync's setting) unless configured otherwise.

Checked targets: natural compression and QSGD at >= 30% of copy
bandwidth at 64 MB; ``threshold_bsearch`` (searching every call), its sampled
variant and ``threshold_reuse`` at >= 5x the speed of exact top-k.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...compress import get

__all__ = ["OPERATORS", "CompressBenchConfig", "format_compress_table", "run_compress_benchmark"]

OPERATORS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("natural", {}),
    ("natural", {"format": 8}),
    ("natural", {"deterministic": True}),
    ("qsgd", {"bits": 2}),
    ("qsgd", {"bits": 4}),
    ("qsgd", {"bits": 8}),
    ("dithering", {}),
    ("natural_dithering", {}),
    ("topk", {"density": 0.001}),
    ("trimmed_topk", {"density": 0.001}),
    ("threshold_bsearch", {"density": 0.001}),
    ("sampled_threshold_bsearch", {"density": 0.001}),
    ("threshold_reuse", {"density": 0.001}),
    ("gaussiank", {"density": 0.001}),
    ("randomk", {"density": 0.001}),
    ("blocktopk", {}),
    ("asq", {"density": 0.001}),
    ("topk+natural", {"density": 0.001}),
)


@dataclasses.dataclass(frozen=True)
class CompressBenchConfig:
    sizes_mb: tuple[int, ...] = (4, 64)
    repeats: int = 7
    device: str = "cpu"
    threads: int = 1
    progress: bool = True


def _time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_compress_benchmark(cfg: CompressBenchConfig) -> list[dict[str, Any]]:
    """Rows of (size, operator, seconds, GB/s, percent of copy, payload bytes)."""
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA device is available")
    device = torch.device(cfg.device)
    torch.set_num_threads(cfg.threads)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows: list[dict[str, Any]] = []
    for mb in cfg.sizes_mb:
        n = mb * (1 << 20) // 4
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(n, generator=g, device=device)
        copy = _time(x.clone, cfg.repeats, sync)
        rows.append(_row(mb, "copy (clone)", "", copy, copy, n * 4))
        for name, params in OPERATORS:
            op = get(name, **params)
            payload_holder: list[torch.Tensor] = []

            def run(op=op, holder=payload_holder, x=x) -> None:  # type: ignore[no-untyped-def]
                holder[:] = [op.compress(x)[0]]

            t = _time(run, cfg.repeats, sync)
            label = ", ".join(f"{k}={v}" for k, v in params.items())
            rows.append(_row(mb, name, label, t, copy, payload_holder[0].numel()))
            if cfg.progress:
                print(
                    f"  {mb:>3} MB {name:<26} {label:<18} {t * 1e3:9.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def _row(mb: int, name: str, params: str, t: float, copy: float, payload: int) -> dict[str, Any]:
    return {
        "size_mb": mb,
        "operator": name,
        "params": params,
        "seconds": t,
        "gb_per_s": mb * (1 << 20) / t / 1e9,
        "percent_of_copy": 100.0 * copy / t,
        "payload_bytes": payload,
    }


def check_targets(rows: Sequence[dict[str, Any]]) -> list[tuple[str, float, float, bool]]:
    """The targets at the largest size: (what, measured, target, met)."""
    big = max(r["size_mb"] for r in rows)
    at = {(r["operator"], r["params"]): r for r in rows if r["size_mb"] == big}
    topk = at[("topk", "density=0.001")]["seconds"]
    out = []
    for name, params in (("natural", ""), ("qsgd", "bits=4")):
        pct = at[(name, params)]["percent_of_copy"]
        out.append(
            (f"{name} {params} % of copy at {big} MB".replace("  ", " "), pct, 30.0, pct >= 30)
        )
    for name in ("threshold_bsearch", "sampled_threshold_bsearch", "threshold_reuse"):
        speed = topk / at[(name, "density=0.001")]["seconds"]
        out.append((f"{name} speed-up over exact top-k (0.1%, {big} MB)", speed, 5.0, speed >= 5))
    return out


def format_compress_table(rows: Sequence[dict[str, Any]], cfg: CompressBenchConfig) -> str:
    head = (
        f"device={cfg.device} threads={cfg.threads} torch={torch.__version__} "
        f"median of {cfg.repeats} runs after a warm-up; float32 N(0,1) input"
    )
    cols = (
        f"{'size':>6} {'operator':<26} {'params':<18} {'ms':>9} {'GB/s':>7} "
        f"{'% copy':>7} {'payload':>12}"
    )
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        lines.append(
            f"{r['size_mb']:>4}MB {r['operator']:<26} {r['params']:<18} {r['seconds'] * 1e3:9.2f} "
            f"{r['gb_per_s']:7.2f} {r['percent_of_copy']:6.1f}% {r['payload_bytes']:>12,}"
        )
    lines.append("")
    lines.append("targets:")
    for what, got, target, met in check_targets(rows):
        lines.append(
            f"  {what:<58} {got:7.2f} (target >= {target:g})  {'met' if met else 'NOT met'}"
        )
    return "\n".join(lines)
