"""Sparse allreduce micro-benchmark in the style of SparCML's sec. 8.1.

Every rank builds a gradient-like sparse vector (``k = density * N`` entries:
a share ``overlap`` of them from a "hot" index set common to all ranks, the rest
uniform random per rank, Gaussian values), then every algorithm reduces it
``repeats`` times after ``warmup`` untimed runs, over ``experiments`` freshly
generated data sets (the paper: 5 data sets x 10 runs, 25th/75th percentiles).

Each timed run starts after a barrier; its time is the slowest rank's, and so
is its local CPU time (the rank process's CPU seconds during the call). Bytes
are the communicator's count for the call (mean over ranks). ``algbw`` and
``busbw`` follow nccl-tests: ``algbw = S / t`` for the vector's ``S = N * isize``
bytes, ``busbw = algbw * 2 (P-1) / P`` (an allreduce's bus factor), so dense and
sparse rows compare on one scale. Every result is checked against a float64
dense allreduce of the same inputs.

Baselines: ``dense`` (the backend's fp32 allreduce) and ``dense_fp16``, the
16-bit dense allreduce of PyTorch's ``fp16_compress_hook`` (cast to float16,
allreduce, cast back; checked within float16 rounding), the headline
comparison for a compressed collective. ``auto`` first runs the calls it
measures on (:mod:`sparcml.collectives.autotune`, untimed, reported as
``tuning``), then is timed like the others.

``overlap = 0`` (every rank's indices independent and uniform, the papers'
setting) is the default and the first-class case; ``overlap > 0`` draws that
share from a hot set common to all ranks, which shrinks the fill-in and favours
the sparse algorithms.

Run with :func:`run_benchmark` (spawns local gloo ranks) or ``sparcml bench``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...collectives import algorithms, choose_algorithm, sparse_allreduce
from ...collectives.autotune import AutoClass, auto_choices, measuring
from ...collectives.registry import algorithm_info, predict
from ...comm import Communicator
from ...comm.launch import run_processes
from ...compress.selection import k_of
from ...costmodel import CostModel
from ...stream import SparseStream
from .harness import Case, Timing, percentiles, time_case, write_csv, write_json
from .peers import PEERS, HierarchicalDense, PeerRunner

TRANSPORT = "torch.distributed gloo, TCP loopback or the emulated cluster, one process per rank"

__all__ = [
    "DENSE16",
    "DENSE_TWOLEVEL",
    "BenchConfig",
    "Row",
    "format_table",
    "gradient_like",
    "run_benchmark",
]

#: The 16-bit dense baseline (``fp16_compress_hook``'s allreduce) by this name.
DENSE16 = "dense_fp16"
#: The two-level dense allreduce (Horovod's hierarchical allreduce, NCCL's pattern
#: across nodes): gloo's reduce-scatter inside each node, allreduce of each shard
#: between nodes, allgather inside the node (:class:`.peers.HierarchicalDense`). A
#: row only where the ranks of a torch.distributed job span several nodes of
#: several ranks each.
DENSE_TWOLEVEL = "dense_twolevel"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run. ``algorithms`` empty means every registered one plus ``auto``."""

    world_size: int = 4
    size: int = 1 << 22
    density: float = 0.01
    overlap: float = 0.0
    dtype: str = "float32"
    algorithms: tuple[str, ...] = ()
    repeats: int = 5
    warmup: int = 1
    experiments: int = 1
    seed: int = 0
    timeout: float = 120.0
    progress: bool = True
    peers: bool = False  # PyTorch's fp16 and PowerSGD DDP hooks on the same vectors
    interleave: bool = False  # time the algorithms round robin instead of one after another

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
        known = set(algorithms(exact=True)) | {"auto", DENSE16, DENSE_TWOLEVEL} | set(PEERS)
        unknown = [a for a in self.algorithms if a not in known]
        if unknown:
            raise ValueError(f"unknown algorithms {unknown}; known: {sorted(known)}")

    def algorithm_list(self, nodes: bool = False) -> list[str]:
        """The rows, dense baselines first; ``nodes``: the ranks span several nodes
        of several ranks (the two-level rows join the default list; their variants
        with another inner algorithm only when named)."""
        flat = [
            a
            for a in algorithms(exact=True, variants=False)
            if nodes or not algorithm_info(a).two_level
        ]
        default = ["dense", DENSE16, *([DENSE_TWOLEVEL] if nodes else []), *flat, "auto"]
        names = list(self.algorithms) or default
        names = list(dict.fromkeys(names))
        if self.peers:
            names += [p for p in PEERS if p not in names]
        # the dense baselines first: speedups are relative to them
        return sorted(names, key=lambda a: (a != "dense", a != DENSE16))


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
    speedup_vs_fp16: float | None = None
    cpu_p50: float = math.nan  # the busiest rank's CPU seconds per call, median
    world_size: int = 1
    chose: str | None = None
    tuning_calls: int = 0  # auto: the calls it measured on before the timed ones
    tuning_s: float = 0.0
    predicted: float | None = None  # the cost model's time (stored calibration), seconds
    inexact: bool = False  # by design not the sum (PowerSGD): the error is reported, not checked

    bytes_in: int = 0

    @property
    def algbw_gbps(self) -> float:
        """nccl-tests' algorithm bandwidth: the vector's bytes over the time, GB/s."""
        return 0.0 if self.p50 <= 0 else self.bytes_in / self.p50 / 1e9

    @property
    def busbw_gbps(self) -> float:
        """nccl-tests' bus bandwidth of an allreduce: ``algbw * 2 (P-1) / P``."""
        p = self.world_size
        return self.algbw_gbps * 2 * (p - 1) / p


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
    k = k_of(density, size)
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
    topo = comm.topology
    names = cfg.algorithm_list(nodes=not topo.is_flat)
    times: dict[str, list[float]] = {a: [] for a in names}
    cpu: dict[str, list[float]] = {a: [] for a in names}
    tuning = {"calls": 0, "s": 0.0}
    sent: dict[str, list[int]] = {a: [] for a in names}
    last: dict[str, dict[str, Any]] = {}
    chose: str | None = None
    show = cfg.progress and comm.rank == 0
    total = cfg.experiments * len(names)
    step = 0
    model = CostModel.load()
    if not topo.is_flat:  # flat algorithms share the node's NIC; the two-level ones know
        model = model.for_topology(topo.ranks_per_node)
    registered = set(algorithms())
    predicted: dict[str, list[float]] = {a: [] for a in names}
    peers: dict[str, Any] = {}
    for a in names:
        if a in PEERS or a == DENSE_TWOLEVEL:
            group = getattr(comm, "group", None)
            if group is None:
                raise ValueError(f"{a} needs a torch.distributed process group (gloo or NCCL)")
            peers[a] = (
                HierarchicalDense(topo, comm.rank)
                if a == DENSE_TWOLEVEL
                else PeerRunner(a, group, comm.world_size)
            )
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
            # the calls auto measures on (without a calibration file), untimed
            t0, calls = time.perf_counter(), 0
            known = len(auto_choices(comm))
            cls = AutoClass.of(comm.world_size, cfg.size, ks, isize, False)
            while calls == 0 or measuring(comm, cls):
                sparse_allreduce(stream, comm)
                calls += 1
            if len(auto_choices(comm)) > known:  # a new class was measured
                tuning["calls"] += calls
                tuning["s"] += time.perf_counter() - t0
            decided = [c.winner for c in auto_choices(comm) if c.winner]
            chose = decided[-1] if decided else choose_algorithm(stream, comm)
        # the peers and the fp16 baseline take dense buckets: densified once, untimed
        dense_in = stream.to_dense() if peers or DENSE16 in names else None
        cases: dict[str, Case] = {}
        for name in names:
            peer = peers.get(name)

            def call(
                peer: Any = peer,
                name: str = name,
                stream: SparseStream = stream,
                dense_in: torch.Tensor | None = dense_in,
            ) -> SparseStream:
                if name == DENSE16:
                    assert dense_in is not None
                    return SparseStream.dense(comm.allreduce(dense_in.half()).to(dtype))
                if peer is None:
                    return sparse_allreduce(stream, comm, algorithm=name)
                assert dense_in is not None
                return SparseStream.dense(peer(dense_in).to(dtype))

            cases[name] = Case(name, call)
        timings = _interleaved(comm, cases, cfg) if cfg.interleave else {}
        for name in names:
            step += 1
            peer = peers.get(name)
            timing = timings.get(name) or time_case(comm, cases[name], cfg.warmup, cfg.repeats)
            result = timing.result
            times[name].extend(timing.times)
            cpu[name].extend(timing.cpu)
            # the peers' hooks go around our communicator: their bytes by formula
            sent[name].extend(
                timing.sent if peer is None else [round(peer.bytes_sent(cfg.size))] * cfg.repeats
            )
            err = (result.to_dense().to(torch.float64) - ref).abs()
            rel = float((err / scale.clamp_min(1e-30)).max()) if err.numel() else 0.0
            tol = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}[cfg.dtype]
            if (peer is not None and name != DENSE_TWOLEVEL) or name == DENSE16:
                # the peers' error in norm: float16 flushes tiny values to subnormals,
                # PowerSGD is a low-rank approximation
                rel = float(err.norm() / ref.norm().clamp_min(1e-30))
            if name in ("torch_fp16_hook", DENSE16):
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
    isize = dtype.itemsize
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
                    tuning_calls=tuning["calls"] if a == "auto" else 0,
                    tuning_s=tuning["s"] if a == "auto" else 0.0,
                    cpu_p50=statistics.median(cpu[a]) if cpu[a] else math.nan,
                    world_size=comm.world_size,
                    predicted=statistics.median(predicted[a]) if predicted[a] else None,
                    bytes_in=cfg.size * isize,
                )
            )
        )
        row = Row(**rows[-1])
        rows[-1].update(algbw_gbps=row.algbw_gbps, busbw_gbps=row.busbw_gbps)
        rows[-1]["ranks_per_node"] = topo.ranks_per_node if not topo.is_flat else 1
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    half = next((r for r in rows if r["algorithm"] == DENSE16), None)
    for r in rows:
        r["speedup_vs_dense"] = dense["p50"] / r["p50"] if dense and r["p50"] > 0 else None
        r["speedup_vs_fp16"] = half["p50"] / r["p50"] if half and r["p50"] > 0 else None
    return rows


def _interleaved(comm: Communicator, cases: dict[str, Case], cfg: BenchConfig) -> dict[str, Timing]:
    """Every case warmed up, then timed round robin (one call of each per round), so a
    shared machine's load changes hit every algorithm alike."""
    for case in cases.values():
        for _ in range(cfg.warmup):
            case.run()
    out: dict[str, Timing] = {}
    for _ in range(cfg.repeats):
        for name, case in cases.items():
            one = time_case(comm, case, 0, 1)
            if name not in out:
                out[name] = one
            else:
                t = out[name]
                t.times += one.times
                t.sent += one.sent
                t.cpu += one.cpu
                t.result = one.result
    return out


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
    """``ok``, ``inexact`` (a lossy method whose error is reported, not bounded),
    ``WRONG``, or ``-`` for a row that compared nothing (no error recorded)."""
    if row.get("max_rel_error") is None or row.get("correct") is None:
        return "-"
    err = float(row["max_rel_error"])
    if not row["correct"] or math.isnan(err):
        return "WRONG"
    return "inexact" if row.get("inexact") else "ok"


def format_table(rows: Sequence[dict[str, Any]], cfg: BenchConfig) -> str:
    """The human-readable table the CLI prints."""
    overlap = f"overlap={cfg.overlap:g}  " if cfg.overlap else ""
    head = (
        f"P={cfg.world_size}  N={cfg.size:,}  density={cfg.density:g}  {overlap}"
        f"dtype={cfg.dtype}  runs={cfg.experiments}x{cfg.repeats} (+{cfg.warmup} warm-up)"
        + ("  interleaved" if getattr(cfg, "interleave", False) else "")
    )
    cols = (
        f"{'algorithm':<32} {'p50 ms':>9} {'p25-p75 ms':>17} {'CPU ms':>8} {'MB sent/rank':>13} "
        f"{'algbw':>7} {'busbw':>7} {'result nnz':>11} {'max rel err':>11} {'check':>7} "
        f"{'vs dense':>9} {'vs fp16':>8} {'model ms':>9} {'meas/model':>10}"
    )
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        name = r["algorithm"] + (f" -> {r['chose']}" if r.get("chose") else "")
        speed = f"{r['speedup_vs_dense']:.2f}x" if r.get("speedup_vs_dense") else "-"
        speed16 = f"{r['speedup_vs_fp16']:.2f}x" if r.get("speedup_vs_fp16") else "-"
        cpu_ms = r.get("cpu_p50", math.nan) * 1e3
        nnz = f"{r['result_nnz']:,}" + (" D" if r["result_dense"] else "")
        pred = r.get("predicted")
        model = f"{pred * 1e3:9.2f} {r['p50'] / pred:10.2f}" if pred else f"{'-':>9} {'-':>10}"
        err = r.get("max_rel_error")
        err_s = f"{err:11.1e}" if err is not None else f"{'-':>11}"
        lines.append(
            f"{name:<32.32} {r['p50'] * 1e3:9.2f} "
            f"{r['p25'] * 1e3:8.2f}-{r['p75'] * 1e3:<8.2f} {cpu_ms:8.1f} "
            f"{r['bytes_sent'] / 1e6:13.3f} {r.get('algbw_gbps', 0.0):7.2f} "
            f"{r.get('busbw_gbps', 0.0):7.2f} {nnz:>11} {err_s} "
            f"{check_label(r):>7} {speed:>9} {speed16:>8} {model}"
        )
    tuned = next((r for r in rows if r.get("tuning_calls")), None)
    if tuned is not None:
        lines.append(
            f"auto measured on {tuned['tuning_calls']} untimed calls first "
            f"({tuned['tuning_s']:.2f} s in all), then ran {tuned['chose']}"
        )
    lines.append(
        "(D: dense result; time = slowest rank, after a barrier; CPU ms = the busiest "
        "rank's process CPU per call; algbw = N*isize/time, busbw = algbw*2(P-1)/P, GB/s "
        "(nccl-tests); dense_fp16 = fp16_compress_hook's 16-bit allreduce; "
        + (
            "dense_twolevel = Horovod's hierarchical dense allreduce (reduce-scatter in the "
            "node, allreduce between nodes, allgather in the node); "
            if any(r["algorithm"] == DENSE_TWOLEVEL for r in rows)
            else ""
        )
        + "bytes = payload; model: "
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
