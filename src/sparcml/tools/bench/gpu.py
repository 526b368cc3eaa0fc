"""``sparcml bench-gpu``: the local kernels on one device, against their anchors, in one run.

Three tables, every figure measured in the same process on the same device:

* **selection** of a ``mb``-MB float32 N(0, 1) gradient (64 MB: 16.8M entries,
  as RedSync's sec. 5 measures) at densities 0.1% and 1%: ``torch.topk`` of the
  magnitudes (PyTorch's radix select, the baseline RedSync names) and every
  selector (``TopK.select``, trimmed top-k, threshold binary search, its sampled
  variant, threshold reuse in its steady state, Gaussiank); speed-up over
  ``torch.topk``, next to RedSync's claim that threshold search is 16-38x faster
  than radix-select top-k (paper 002 sec. 5.1);
* **quantizers**: ``compress`` and ``decompress`` of natural compression, QSGD
  (2/4/8 bits) and the ditherings on the same gradient, as a share of a
  device-to-device copy of it (``clone``: reads the input and writes a new tensor,
  as a quantizer does); the target is at least 50%;
* **stream kernels**: the local steps of the sparse collectives on uniform random
  index sets (the papers' setting) at 1% density of the gradient, split into
  ``P`` ranges: merge-sum of ``P`` sorted pieces, two-way merge, split, encode,
  decode, concatenation, decode-into-result; each as GB/s of the bytes it must
  read and write and as a share of the copy's GB/s.

Timings: the median of ``repeats`` calls after a warm-up, each call between two
device synchronisations (``torch.cuda.synchronize``), so a call's host work and
its kernels both count, as a training step sees them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...compress import get
from ...compress.selection import k_of
from .local import stream_cases, uniform_stream

log = logging.getLogger(__name__)

__all__ = [
    "QUANTIZERS",
    "SELECTORS",
    "GpuBenchConfig",
    "device_name",
    "format_gpu_tables",
    "gpu_targets",
    "rows_of",
    "run_gpu_benchmark",
]

#: RedSync's measured speed-up of threshold binary search over radix-select top-k
REDSYNC_CLAIM = (16.0, 38.0)
#: quantizer throughput target, percent of a device-to-device copy
QUANTIZER_TARGET = 50.0

SELECTORS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("topk", {}),
    ("trimmed_topk", {}),
    ("threshold_bsearch", {}),
    ("sampled_threshold_bsearch", {}),
    ("threshold_reuse", {}),
    ("gaussiank", {}),
)
QUANTIZERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("natural", {}),
    ("natural", {"format": 8}),
    ("qsgd", {"bits": 2}),
    ("qsgd", {"bits": 4}),
    ("qsgd", {"bits": 8}),
    ("dithering", {}),
    ("natural_dithering", {}),
)


@dataclasses.dataclass(frozen=True)
class GpuBenchConfig:
    """What ``sparcml bench-gpu`` measures."""

    device: str = "cuda"
    mb: int = 64
    densities: tuple[float, ...] = (0.001, 0.01)
    stream_density: float = 0.01
    world: int = 8
    repeats: int = 11
    progress: bool = True


def _timer(device: torch.device, failures: list[str]) -> Callable[[Callable[[], Any], int], float]:
    """A median timer; a callable that raises times as NaN, its error kept in ``failures``."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def median_s(fn: Callable[[], Any], repeats: int) -> float:
        try:
            fn()  # warm-up: kernels compiled/loaded, caches and allocator filled
            sync()
        except Exception as e:  # one kernel failing leaves the others' rows measured
            log.error(
                "bench-gpu: %s failed: %s: %s", getattr(fn, "__name__", fn), type(e).__name__, e
            )
            failures.append(f"{type(e).__name__}: {e}")
            return float("nan")
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return median_s


def _label(name: str, params: dict[str, Any]) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"{name} ({extra})" if extra else name


def run_gpu_benchmark(cfg: GpuBenchConfig) -> dict[str, list[dict[str, Any]]]:
    """The three tables' rows: ``{"selection": [...], "quantizers": [...], "streams": [...]}``,
    and ``"failures"``: the error of each kernel that raised (its row's time is NaN).

    Raises:
        ValueError: the device is CUDA and none is available, or a size is not positive.
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device} asked for, but no CUDA device is available")
    if cfg.mb <= 0 or cfg.world <= 0 or cfg.repeats <= 0:
        raise ValueError("mb, world and repeats must be positive")
    failures: list[str] = []
    median_s = _timer(device, failures)

    def say(text: str) -> None:
        if cfg.progress:
            print(f"  {text}", file=sys.stderr, flush=True)

    n = cfg.mb * (1 << 20) // 4
    x = torch.randn(n, generator=torch.Generator(device=device).manual_seed(0), device=device)
    copy_s = median_s(x.clone, cfg.repeats)
    copy_gbs = 2 * x.numel() * 4 / copy_s / 1e9  # bytes read + written
    say(f"copy (clone) of {cfg.mb} MB: {copy_s * 1e3:.3f} ms, {copy_gbs:.0f} GB/s read+written")

    selection: list[dict[str, Any]] = []
    for density in cfg.densities:
        k = k_of(density, n)
        base_s = median_s(lambda k=k: torch.topk(x.abs(), k, sorted=False), cfg.repeats)
        selection.append(_sel_row(density, "torch.topk (radix select)", base_s, base_s, k))
        say(f"{density:.1%} torch.topk: {base_s * 1e3:.3f} ms")
        for name, params in SELECTORS:
            op = get(name, density=density, **params)
            held: list[int] = []

            def run_s(op: Any = op, held: list[int] = held) -> None:
                held[:] = [op.select(x).nnz]

            # (threshold_reuse: its warm-up call sets the threshold it then reuses)
            t = median_s(run_s, cfg.repeats)
            nnz = held[0] if held else 0
            selection.append(_sel_row(density, _label(name, params), t, base_s, nnz))
            say(f"{density:.1%} {_label(name, params)}: {t * 1e3:.3f} ms")

    quantizers: list[dict[str, Any]] = [
        {
            "operator": "copy (clone)",
            "compress_ms": copy_s * 1e3,
            "decompress_ms": copy_s * 1e3,
            "compress_pct_of_copy": 100.0,
            "decompress_pct_of_copy": 100.0,
            "payload_bytes": n * 4,
        }
    ]
    for name, params in QUANTIZERS:
        op = get(name, **params)
        out: list[Any] = []

        def run_c(op: Any = op, out: list[Any] = out) -> None:
            out[:] = [op.compress(x)]

        c = median_s(run_c, cfg.repeats)
        if not out:
            continue
        payload, ctx = out[0]
        d = median_s(lambda op=op, p=payload, ctx=ctx: op.decompress(p, ctx), cfg.repeats)
        quantizers.append(
            {
                "operator": _label(name, params),
                "compress_ms": c * 1e3,
                "decompress_ms": d * 1e3,
                "compress_pct_of_copy": 100.0 * copy_s / c,
                "decompress_pct_of_copy": 100.0 * copy_s / d,
                "payload_bytes": int(payload.numel() * payload.element_size()),
            }
        )
        say(f"{_label(name, params)}: compress {c * 1e3:.3f} ms, decompress {d * 1e3:.3f} ms")
    try:
        streams = _stream_rows(cfg, n, device, median_s, copy_gbs, say)
    except Exception as e:  # the inputs could not be built on this device
        log.error("bench-gpu: stream kernels' inputs failed: %s: %s", type(e).__name__, e)
        failures.append(f"stream kernels' inputs: {type(e).__name__}: {e}")
        streams = []
    return {
        "selection": selection,
        "quantizers": quantizers,
        "streams": streams,
        "failures": [{"error": f} for f in failures],
    }


def _sel_row(density: float, op: str, t: float, base: float, nnz: int) -> dict[str, Any]:
    return {
        "density": density,
        "operator": op,
        "ms": t * 1e3,
        "speedup_over_torch_topk": base / t,
        "selected": nnz,
    }


def _stream_rows(
    cfg: GpuBenchConfig,
    n: int,
    device: torch.device,
    median_s: Callable[[Callable[[], Any], int], float],
    copy_gbs: float,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    p = cfg.world
    k = k_of(cfg.stream_density, n)
    a = uniform_stream(n, k, 7, device)
    bounds = [i * (n // p) for i in range(p)] + [n]
    cases = [
        *stream_cases(n, p, cfg.stream_density, device),  # bench-local's, on this device
        (f"split into {p} ranges", a.nnz, 2 * a.nnz * (8 + 4), lambda: a.split(bounds)),
    ]
    rows = []
    for name, elems, nbytes, fn in cases:
        t = median_s(fn, cfg.repeats)
        gbs = nbytes / t / 1e9
        rows.append(
            {
                "kernel": name,
                "entries": elems,
                "bytes": nbytes,
                "ms": t * 1e3,
                "gb_per_s": gbs,
                "pct_of_copy": 100.0 * gbs / copy_gbs,
            }
        )
        say(f"{name}: {t * 1e3:.3f} ms")
    return rows


def gpu_targets(tables: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met): RedSync's claim and the quantizer target."""
    out: list[tuple[str, float, str, bool]] = []
    lo, _ = REDSYNC_CLAIM
    for r in tables["selection"]:
        if math.isnan(r["ms"]):
            continue
        if r["operator"].startswith(("threshold_bsearch", "sampled_threshold", "threshold_reuse")):
            s = r["speedup_over_torch_topk"]
            out.append(
                (
                    f"{r['operator']} over torch.topk at {r['density']:.1%}",
                    s,
                    f">= {lo:g}x",
                    s >= lo,
                )
            )
    for r in tables["quantizers"][1:]:
        if math.isnan(r["compress_ms"]):
            continue
        pct = r["compress_pct_of_copy"]
        out.append(
            (
                f"{r['operator']} compress, % of copy",
                pct,
                f">= {QUANTIZER_TARGET:g}%",
                pct >= QUANTIZER_TARGET,
            )
        )
    return out


def device_name(device: str) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    import platform

    return platform.processor() or platform.machine()


def format_gpu_tables(tables: dict[str, list[dict[str, Any]]], cfg: GpuBenchConfig) -> str:
    n = cfg.mb * (1 << 20) // 4
    lines = [
        f"device={cfg.device} ({device_name(cfg.device)}) torch={torch.__version__} "
        f"gradient {cfg.mb} MB float32 N(0,1) ({n:,} entries); median of {cfg.repeats} "
        "calls after a warm-up, each between two device synchronisations",
        "",
        "selection (speed-up over torch.topk; RedSync sec. 5.1 claims 16-38x for threshold search)",
    ]
    cols = f"{'density':>8} {'operator':<34} {'ms':>9} {'speed-up':>9} {'selected':>10}"
    lines += [cols, "-" * len(cols)]
    for r in tables["selection"]:
        lines.append(
            f"{r['density']:>7.1%} {r['operator']:<34} {r['ms']:9.3f} "
            f"{r['speedup_over_torch_topk']:8.2f}x {r['selected']:>10,}"
        )
    lines += ["", f"quantizers (share of a device-to-device copy; target >= {QUANTIZER_TARGET:g}%)"]
    cols = (
        f"{'operator':<26} {'compress ms':>12} {'% copy':>7} {'decompress ms':>14} "
        f"{'% copy':>7} {'payload':>12}"
    )
    lines += [cols, "-" * len(cols)]
    for r in tables["quantizers"]:
        lines.append(
            f"{r['operator']:<26} {r['compress_ms']:12.3f} {r['compress_pct_of_copy']:6.1f}% "
            f"{r['decompress_ms']:14.3f} {r['decompress_pct_of_copy']:6.1f}% "
            f"{r['payload_bytes']:>12,}"
        )
    lines += [
        "",
        f"stream kernels (uniform random indices, {cfg.stream_density:.0%} of the gradient, "
        f"P = {cfg.world}; GB/s of the bytes each must read and write)",
    ]
    cols = f"{'kernel':<52} {'entries':>11} {'ms':>9} {'GB/s':>8} {'% copy':>7}"
    lines += [cols, "-" * len(cols)]
    for r in tables["streams"]:
        lines.append(
            f"{r['kernel']:<52} {r['entries']:>11,} {r['ms']:9.3f} {r['gb_per_s']:8.2f} "
            f"{r['pct_of_copy']:6.1f}%"
        )
    if tables.get("failures"):
        lines += ["", "FAILED (timed as nan):"] + [f"  {f['error']}" for f in tables["failures"]]
    lines += ["", "targets:"]
    for what, got, target, met in gpu_targets(tables):
        lines.append(f"  {what:<56} {got:8.2f} ({target})  {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def rows_of(tables: dict[str, list[dict[str, Any]]]) -> Sequence[dict[str, Any]]:
    """Every row with its table's name (the JSON file's rows)."""
    return [{"table": name, **r} for name, rows in tables.items() for r in rows]
