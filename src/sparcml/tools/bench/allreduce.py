"""Sparse allreduce micro-benchmark in the style of SparCML's sec. 8.1.

Every rank builds a gradient-like sparse vector (``k = density * N`` entries:
a share ``overlap`` of them from a "hot" index set common to all ranks, the rest
uniform random per rank, Gaussian values), then every algorithm reduces it
``repeats`` times after ``warmup`` untimed runs, over ``experiments`` freshly
generated data sets (the paper: 5 data sets x 10 runs, 25th/75th percentiles).

Each timed run starts after a barrier; its time is the slowest rank's. Bytes
are the communicator's count for the call (mean over ranks). Every result is
checked against a float64 dense allreduce of the same inputs.

Run with :func:`run_benchmark` (spawns local gloo ranks) or ``sparcml bench``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...collectives import algorithms, choose_algorithm, sparse_allreduce
from ...collectives.registry import algorithm_info, predict
from ...comm import Communicator
from ...comm.launch import run_processes
from ...costmodel import CostModel
from ...stream import SparseStream
from .harness import Case, percentiles, time_case, write_csv, write_json
from .peers import PEERS, PeerRunner

TRANSPORT = "torch.distributed gloo, TCP loopback or the emulated cluster, one process per rank"

__all__ = ["BenchConfig", "Row", "format_table", "gradient_like", "run_benchmark"]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run. ``algorithms`` empty means every registered one plus ``auto``."""

    world_size: int = 4
    size: int = 1 << 22
    density: float = 0.01
    overlap: float = 0.5
    dtype: str = "float32"
    algorithms: tuple[str, ...] = ()
    repeats: int = 5
    warmup: int = 1
    experiments: int = 1
    seed: int = 0
    timeout: float = 120.0
    progress: bool = True
    peers: bool = False  # PyTorch's fp16 and PowerSGD DDP hooks on the same vectors

    def validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if self.size < 1:
            raise ValueError(f"size N must be at least 1, got {self.size}")
        if not 0.0 <= self.density <= 1.0:
            raise ValueError(f"density must lie in [0, 1], got {self.density}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must lie in [0, 1], got {self.overlap}")
        if self.repeats < 1 or self.warmup < 0 or self.experiments < 1:
            raise ValueError("repeats and experiments must be >= 1, warmup >= 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        known = set(algorithms(exact=True)) | {"auto"} | set(PEERS)
        unknown = [a for a in self.algorithms if a not in known]
        if unknown:
            raise ValueError(f"unknown algorithms {unknown}; known: {sorted(known)}")

    def algorithm_list(self) -> list[str]:
        names = list(self.algorithms) or [*algorithms(exact=True), "auto"]
        if self.peers:
            names += [p for p in PEERS if p not in names]
        # the dense baseline first: speedups are relative to it
        return sorted(names, key=lambda a: a != "dense")


_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclasses.dataclass
class Row:
    """One algorithm's figures (times in seconds, bytes per rank per call)."""

    algorithm: str
    p25: float
    p50: float
    p75: float
    bytes_sent: float
    bytes_sent_max: int
    result_nnz: int
    result_dense: bool
    max_rel_error: float
    correct: bool
    speedup_vs_dense: float | None = None
    chose: str | None = None
    predicted: float | None = None  # the cost model's time (stored calibration), seconds
    inexact: bool = False  # by design not the sum (PowerSGD): the error is reported, not checked

    @property
    def algbw_gbps(self) -> float:
        return 0.0 if self.p50 <= 0 else self.bytes_in / self.p50 / 1e9

    bytes_in: int = 0


def gradient_like(
    size: int,
    density: float,
    rank: int,
    *,
    overlap: float = 0.5,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> SparseStream:
    """A rank's sparse "gradient": ``k = density*N`` entries, a share ``overlap`` common.

    The common share comes from a hot set of ``2 * k_common`` indices drawn with
    a seed all ranks share (heavy-hitter coordinates that many workers select),
    the rest uniformly at random per rank.
    """
    k = round(density * size)
    k_common = round(overlap * k)
    shared = torch.Generator().manual_seed(seed * 7_919 + 17)
    own = torch.Generator().manual_seed(seed * 7_919 + 1_000_003 * (rank + 1))
    hot = torch.randint(0, size, (2 * k_common,), generator=shared)
    common = hot[torch.randint(0, max(hot.numel(), 1), (k_common,), generator=own)]
    rest = torch.randint(0, size, (k - k_common,), generator=own)
    idx = torch.unique(torch.cat([common, rest]))
    vals = torch.randn(idx.numel(), generator=own, dtype=torch.float32).to(dtype)
    return SparseStream(idx, vals, size)


def rank_main(comm: Communicator, cfg: BenchConfig) -> list[dict[str, Any]] | None:
    dtype = _DTYPES[cfg.dtype]
    names = cfg.algorithm_list()
    times: dict[str, list[float]] = {a: [] for a in names}
    sent: dict[str, list[int]] = {a: [] for a in names}
    last: dict[str, dict[str, Any]] = {}
    chose: str | None = None
    show = cfg.progress and comm.rank == 0
    total = cfg.experiments * len(names)
    step = 0
    model = CostModel.load()
    registered = set(algorithms())
    predicted: dict[str, list[float]] = {a: [] for a in names}
    peers: dict[str, PeerRunner] = {}
    for a in names:
        if a in PEERS:
            group = getattr(comm, "group", None)
            if group is None:
                raise ValueError(f"{a} needs a torch.distributed process group (gloo or NCCL)")
            peers[a] = PeerRunner(a, group, comm.world_size)
    for e in range(cfg.experiments):
        stream = gradient_like(
            cfg.size, cfg.density, comm.rank, overlap=cfg.overlap, seed=cfg.seed + e, dtype=dtype
        )
        ks = [int(t) for t in comm.allgather(torch.tensor([stream.nnz]))]
        isize = stream.values.element_size()
        for a in names:
            if a in registered and algorithm_info(a).cost is not None:
                predicted[a].append(predict(model, a, comm.world_size, cfg.size, ks, isize))
        ref = comm.allreduce(stream.to_dense().to(torch.float64))
        scale = comm.allreduce(stream.to_dense().to(torch.float64).abs())
        if "auto" in names:
            chose = choose_algorithm(stream, comm)
        # the peers take DDP's dense buckets: densified once, outside the timing
        dense_in = stream.to_dense() if peers else None
        for name in names:
            step += 1
            peer = peers.get(name)

            def call(
                peer: PeerRunner | None = peer,
                name: str = name,
                stream: SparseStream = stream,
                dense_in: torch.Tensor | None = dense_in,
            ) -> SparseStream:
                if peer is None:
                    return sparse_allreduce(stream, comm, algorithm=name)
                assert dense_in is not None
                return SparseStream.dense(peer(dense_in).to(dtype))

            timing = time_case(comm, Case(name, call), cfg.warmup, cfg.repeats)
            result = timing.result
            times[name].extend(timing.times)
            # the peers' hooks go around our communicator: their bytes by formula
            sent[name].extend(
                timing.sent if peer is None else [round(peer.bytes_sent(cfg.size))] * cfg.repeats
            )
            err = (result.to_dense().to(torch.float64) - ref).abs()
            rel = float((err / scale.clamp_min(1e-30)).max()) if err.numel() else 0.0
            tol = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}[cfg.dtype]
            if peer is not None:
                # the peers' error in norm: float16 flushes tiny values to subnormals,
                # PowerSGD is a low-rank approximation
                rel = float(err.norm() / ref.norm().clamp_min(1e-30))
            if name == "torch_fp16_hook":
                tol = max(tol, 2e-3)  # float16 rounding of the values and the ring's sums
            if name == "torch_powersgd_hook":
                # no accuracy bound to check: every rank must hold the same bits
                dense_out = result.to_dense().double()
                digest = torch.stack([dense_out.sum(), (dense_out * dense_out).sum()])
                ok = all(torch.equal(d, digest) for d in comm.allgather(digest))
            else:
                ok = bool(comm.allreduce(torch.tensor([rel <= tol], dtype=torch.int32), op="min"))
            prev = last.get(name, {"correct": True, "err": 0.0})
            last[name] = {
                "nnz": result.count_nonzero(),
                "dense": result.is_dense,
                "err": max(rel, prev["err"]),
                "correct": ok and prev["correct"],
            }
            if show:
                med = statistics.median(times[name][-cfg.repeats :])
                print(
                    f"  [{step}/{total}] {name:<24} {med * 1e3:9.2f} ms  {'ok' if ok else 'WRONG'}",
                    file=sys.stderr,
                    flush=True,
                )
    mean_sent = {
        a: comm.allreduce(torch.tensor([statistics.fmean(sent[a])], dtype=torch.float64))
        / comm.world_size
        for a in names
    }
    max_sent = {
        a: comm.allreduce(torch.tensor([max(sent[a])], dtype=torch.int64), op="max") for a in names
    }
    if comm.rank != 0:
        return None
    rows = []
    isize = torch.empty((), dtype=dtype).element_size()
    for a in names:
        p25, p50, p75 = percentiles(times[a])
        rows.append(
            dataclasses.asdict(
                Row(
                    algorithm=a,
                    p25=p25,
                    p50=p50,
                    p75=p75,
                    bytes_sent=float(mean_sent[a]),
                    bytes_sent_max=int(max_sent[a]),
                    result_nnz=int(last[a]["nnz"]),
                    result_dense=bool(last[a]["dense"]),
                    max_rel_error=float(last[a]["err"]),
                    correct=bool(last[a]["correct"]) and math.isfinite(float(last[a]["err"])),
                    inexact=a == "torch_powersgd_hook",
                    chose=chose if a == "auto" else None,
                    predicted=statistics.median(predicted[a]) if predicted[a] else None,
                    bytes_in=cfg.size * isize,
                )
            )
        )
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    for r in rows:
        r["speedup_vs_dense"] = dense["p50"] / r["p50"] if dense and r["p50"] > 0 else None
    return rows


def run_benchmark(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Spawn ``cfg.world_size`` gloo ranks on loopback and run the benchmark; rank 0's rows."""
    cfg.validate()
    out = run_processes(
        cfg.world_size, rank_main, cfg, timeout=cfg.timeout, deadline=cfg.timeout * 20
    )
    rows = out[0]
    assert rows is not None
    return rows


def check_label(row: dict[str, Any]) -> str:
    """``ok``, ``inexact`` (a lossy method whose error is reported, not bounded) or ``WRONG``."""
    err = float(row.get("max_rel_error", 0.0))
    if not row["correct"] or math.isnan(err):
        return "WRONG"
    return "inexact" if row.get("inexact") else "ok"


def format_table(rows: Sequence[dict[str, Any]], cfg: BenchConfig) -> str:
    """The human-readable table the CLI prints."""
    overlap = f"overlap={cfg.overlap:g}  " if cfg.overlap else ""
    head = (
        f"P={cfg.world_size}  N={cfg.size:,}  density={cfg.density:g}  {overlap}"
        f"dtype={cfg.dtype}  runs={cfg.experiments}x{cfg.repeats} (+{cfg.warmup} warm-up)"
    )
    cols = (
        f"{'algorithm':<32} {'p50 ms':>9} {'p25-p75 ms':>17} {'MB sent/rank':>13} "
        f"{'result nnz':>11} {'max rel err':>11} {'check':>7} {'vs dense':>9} "
        f"{'model ms':>9} {'meas/model':>10}"
    )
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        name = r["algorithm"] + (f" -> {r['chose']}" if r.get("chose") else "")
        speed = f"{r['speedup_vs_dense']:.2f}x" if r.get("speedup_vs_dense") else "-"
        nnz = f"{r['result_nnz']:,}" + (" D" if r["result_dense"] else "")
        pred = r.get("predicted")
        model = f"{pred * 1e3:9.2f} {r['p50'] / pred:10.2f}" if pred else f"{'-':>9} {'-':>10}"
        lines.append(
            f"{name:<32.32} {r['p50'] * 1e3:9.2f} "
            f"{r['p25'] * 1e3:8.2f}-{r['p75'] * 1e3:<8.2f} "
            f"{r['bytes_sent'] / 1e6:13.3f} {nnz:>11} {r['max_rel_error']:11.1e} "
            f"{check_label(r):>7} {speed:>9} {model}"
        )
    lines.append(
        "(D: dense result; time = slowest rank, after a barrier; bytes = payload; model: "
        f"alpha-beta-gamma prediction from {CostModel.load().source}; check: ok = within the "
        "dtype's tolerance of the float64 sum, inexact = not the sum by design (error "
        "reported; identical bits on every rank checked), WRONG = beyond tolerance, NaN or "
        "ranks differ)"
    )
    return "\n".join(lines)


def write_outputs(
    rows: Sequence[dict[str, Any]],
    cfg: BenchConfig,
    json_path: str | None = None,
    csv_path: str | None = None,
) -> None:
    """Save the rows with the configuration, the machine and the command next to them."""
    if json_path:
        write_json(json_path, "bench", list(rows), dataclasses.asdict(cfg), transport=TRANSPORT)
    if csv_path:
        fixed = {"world_size": cfg.world_size, "size": cfg.size, "density": cfg.density}
        write_csv(csv_path, rows, fixed)


def sweep_table(
    docs: Sequence[dict[str, Any]], over: str
) -> tuple[str, list[tuple[float, str]], dict[str, list[tuple[float, float, float, float]]]]:
    """Combine bench JSON documents along ``over`` (``P`` or ``density``).

    Returns:
        A markdown table (p50 ms per algorithm and x), the fastest algorithm at
        each x (its changes are the crossovers), and per algorithm the points
        ``(x, p25, p50, p75)``.
    """
    key = {"P": "world_size", "density": "density"}[over]
    series: dict[str, list[tuple[float, float, float, float]]] = {}
    for doc in sorted(docs, key=lambda d: d["config"][key]):
        x = float(doc["config"][key])
        for r in doc["rows"]:
            if r["algorithm"] == "auto":
                continue
            series.setdefault(r["algorithm"], []).append((x, r["p25"], r["p50"], r["p75"]))
    xs = sorted({pt[0] for pts in series.values() for pt in pts})
    algs = sorted(series, key=lambda a: (a != "dense", a))
    lines = [
        f"| {over} | " + " | ".join(algs) + " | fastest |",
        "|---:|" + "---:|" * len(algs) + "---|",
    ]
    best: list[tuple[float, str]] = []
    for x in xs:
        at = {a: next((pt[2] for pt in series[a] if pt[0] == x), None) for a in algs}
        have = {a: t for a, t in at.items() if t is not None}
        fastest = min(have, key=lambda a: have[a])
        best.append((x, fastest))
        cells = " | ".join("-" if at[a] is None else f"{at[a] * 1e3:,.1f}" for a in algs)
        lines.append(f"| {x:g} | {cells} | {fastest} |")
    return "\n".join(lines), best, series


def crossovers(best: Sequence[tuple[float, str]]) -> list[str]:
    """Where the fastest algorithm changes between neighbouring x values."""
    out = []
    for (x0, a0), (x1, a1) in itertools.pairwise(best):
        if a0 != a1:
            out.append(f"between {x0:g} and {x1:g}: {a0} -> {a1}")
    return out


def plot_sweep(
    series: dict[str, list[tuple[float, float, float, float]]], over: str, path: Path, title: str
) -> Path:
    """Log-log plot of p50 with p25-p75 bars, as SparCML's Fig. 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a, pts in sorted(series.items()):
        pts = sorted(pts)
        x = [p[0] for p in pts]
        y = [p[2] for p in pts]
        err = [[p[2] - p[1] for p in pts], [p[3] - p[2] for p in pts]]
        style = "k-" if a == "dense" else "-"
        ax.errorbar(x, y, yerr=err, fmt=style + "o", capsize=3, label=a, markersize=4)
    ax.set_xscale("log", base=2 if over == "P" else 10)
    ax.set_yscale("log")
    ax.set(xlabel=over, ylabel="time [s] (p50, p25-p75)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
