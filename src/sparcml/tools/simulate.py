"""``sparcml simulate``: the real collectives on a virtual clock, for up to thousands of ranks.

For every world size and algorithm, :func:`run_simulation` starts ``P`` simulated
ranks (:mod:`sparcml.comm.sim`), lets every rank generate its own scaled-down
vector (``N / s`` elements, ``k / s`` pairs, uniform random indices unless an
``overlap`` share comes from a common hot set, as in ``sparcml bench``), runs
the registered algorithm on them and reads the slowest rank's virtual clock.
Results are checked: exact algorithms against the dense sum of the same inputs,
every algorithm for bitwise-identical results on every rank.

Printed per row: simulated time, the closed-form alpha-beta-gamma prediction
registered with the algorithm (the formula ``auto`` decides with), the
largest rank's full-scale bytes sent, the result's nnz (scaled back) next to
Appendix B.1's expected fill-in ``E[K] = N (1 - prod_i (1 - k_i/N))``.

What to run and check comes from the algorithm registry
(:mod:`sparcml.collectives.registry`): every registered algorithm but aliases
by default; ``exact`` ones are checked against the dense sum. Algorithms whose
input is the dense accumulator (Gaussiank, Ok-Topk) run on Gaussian
accumulators with ``k = d N``; a stateful one (Ok-Topk) runs twice per row: the
first call computes thresholds and region boundaries (timed on its own:
``refresh_s``), the second, the steady state that ``tau``/``tau'`` make
typical, is ``time_s``; ``amortised_s`` is the mean per call over a threshold
period of ``tau'`` calls (one refresh, ``tau' - 1`` steady calls), which the
registered cost formula also amortises.

Algorithms registered ``quadratic`` (every rank's Python work grows like ``P``
per call, so like ``P^2`` in all: the split family and Ok-Topk split every
vector into ``P`` pieces; TopkA decodes ``P`` streams) are simulated up to
``quadratic_limit`` ranks; beyond it their row shows the closed-form model only
(``source = model``), so the curves still reach 4096.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..collectives.codec import EXACT
from ..collectives.oktopk import OkTopkState
from ..collectives.registry import algorithm_info, algorithms, predict
from ..comm.sim import Charge, SimCommunicator, bytes_charge, simulate_ranks
from ..comm.topology import Topology
from ..compress.selection import k_of
from ..costmodel import CostModel, expected_fill_in
from ..indexcode import layout
from ..stream import SparseStream, dense_threshold_of
from ..wire import HEADER_BYTES, peek, peek_bundle
from .bench.allreduce import gradient_like
from .bench.harness import write_json

__all__ = [
    "MEASURED_REPEATS",
    "SimConfig",
    "default_algorithms",
    "format_sim_table",
    "plot_simulation",
    "run_simulation",
]


#: timed calls per row with measured compute (their median): one call is one sample
#: of the machine's timing (docs/cluster.md, "Again with ordered turns and five calls a row")
MEASURED_REPEATS = 5


def default_algorithms() -> list[str]:
    """What ``sparcml simulate`` runs by default: every registered algorithm but aliases
    and variants (``twolevel_shard+dsar_split_allgather`` runs when named)."""
    return algorithms(aliases=False, variants=False)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """What to simulate.

    Attributes:
        world_sizes: the ``P`` values.
        size: the full vector length ``N`` whose costs are charged.
        density: ``d``: every rank holds ``k = d N`` pairs.
        overlap: share of each rank's indices from a common hot set (0: uniform).
        algorithms: algorithm names (default :func:`default_algorithms`).
        sim_elements: memory budget: ranks together hold about this many
            scaled elements (``N / s * P``); ``s`` is the smallest power of two
            that keeps within it, and ``N / s`` is at least ``min_sim_size``.
        min_sim_size: smallest scaled vector.
        quadratic_limit: largest ``P`` at which ``P^2``-work algorithms run.
        compute: ``"model"`` (gamma per element) or ``"measured"`` local work.
        cores: with measured compute, cores of the predicted machine shared by
            all ranks (e.g. the host's core count for an emulated cluster whose
            ranks all run on one host); None: one core per rank.
        repeats: timed calls per row, each from clocks set to zero; the row's time
            is their median (of the slowest rank's finish), every call in
            ``calls_s``. None: :data:`MEASURED_REPEATS` with measured compute (a
            sample of the machine's timing, one call can be far off; a median of
            calls is what ``sparcml bench`` reports too), 1 with the model (every
            call takes the same time). The bytes and messages of a row are its
            last call's. A stateful algorithm (Ok-Topk) carries its state from call
            to call: past ``tau' - 1`` calls a threshold refresh falls among them
            (the median hides one); ``refresh_s`` is one call of a fresh state.
        calibration: a calibration JSON (default: the stored one, else defaults).
        seed: data seed.
        progress: print one line per row on stderr.
        ranks_per_node: ranks per node (1: every rank its own node, the flat
            model); with more, ranks sit in contiguous nodes whose messages inside
            cost the calibration's ``alpha_intra``/``beta_intra`` and between
            nodes queue on the node's shared NIC (:mod:`sparcml.comm.sim`), and the
            two-level algorithms join the default list.
    """

    world_sizes: tuple[int, ...] = (4, 8, 16, 64, 256, 1024, 4096)
    size: int = 1 << 24
    density: float = 0.00781
    overlap: float = 0.0
    algorithms: tuple[str, ...] = ()
    sim_elements: int = 1 << 26
    min_sim_size: int = 1 << 14
    quadratic_limit: int = 1024
    calibration: str | None = None
    seed: int = 0
    progress: bool = True
    compute: str = "model"
    cores: int | None = None
    ranks_per_node: int = 1
    repeats: int | None = None

    @property
    def timed_calls(self) -> int:
        """``repeats``, or its default for the compute mode."""
        if self.repeats is not None:
            return self.repeats
        return MEASURED_REPEATS if self.compute == "measured" else 1

    def cpu_share(self, world_size: int) -> float:
        """Ranks per core on the predicted machine (measured compute), at least 1."""
        return 1.0 if not self.cores else max(1.0, world_size / self.cores)

    def validate(self) -> None:
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"world sizes must be >= 1, got {self.world_sizes}")
        if self.size < 1:
            raise ValueError(f"size must be positive, got {self.size}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
        if self.compute not in ("model", "measured"):
            raise ValueError(f"compute must be 'model' or 'measured', got {self.compute!r}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks per node must be >= 1, got {self.ranks_per_node}")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        odd = [p for p in self.world_sizes if p % self.ranks_per_node]
        if odd:
            raise ValueError(
                f"world sizes {odd} are not multiples of {self.ranks_per_node} ranks per node"
            )
        if self.compute == "measured":
            # measured local work is the ranks' real work on the data they hold: on
            # vectors scaled down s times it would be charged for 1/s of the pairs
            scaled = [p for p in self.world_sizes if self.scale_for(p) > 1]
            if scaled:
                p = max(scaled)
                raise ValueError(
                    f"measured compute times the ranks' work on full-size vectors, but at "
                    f"P={p} the ranks would hold {self.size * p:,} elements, over the "
                    f"memory budget sim_elements={self.sim_elements:,} (data scaled down "
                    f"{self.scale_for(p)}x); raise sim_elements (--sim-elements) to at least "
                    f"{self.size * p:,}, lower P or N, or use compute='model'"
                )
        unknown = [a for a in self.algorithms if a not in algorithms()]
        if unknown:
            raise ValueError(f"cannot simulate {unknown}; choose from {', '.join(algorithms())}")

    def algorithm_list(self) -> list[str]:
        """The algorithms to run (the two-level ones by default only on nodes of
        several ranks)."""
        if self.algorithms:
            return list(self.algorithms)
        nodes = self.ranks_per_node > 1
        return [a for a in default_algorithms() if nodes or not algorithm_info(a).two_level]

    def topology(self, world_size: int) -> Topology | None:
        """The node layout at ``P`` ranks (None: flat)."""
        if self.ranks_per_node == 1:
            return None
        return Topology.regular(world_size, self.ranks_per_node)

    def scale_for(self, world_size: int) -> int:
        """The data scale ``s`` at ``P`` ranks (a power of two, dividing the work)."""
        s = 1
        while (
            self.size // (2 * s) >= self.min_sim_size
            and (self.size // s) * world_size > self.sim_elements
        ):
            s *= 2
        return s


def charge(buf: torch.Tensor, scale: int = 1) -> Charge:
    """What a point-to-point payload costs at full scale (data scaled down ``s`` times).

    Sparse-stream messages and bundles of them are read with the wire module's
    own header parser (:func:`sparcml.wire.peek`): ``nnz`` and dense lengths are
    multiplied by ``s`` and indices charged at the width the full dimension
    needs. Anything else (Ok-Topk's fixed-width records, quantized payloads) is
    charged ``s`` times its length (:func:`~sparcml.comm.sim.bytes_charge`).

    Example:
        >>> from sparcml.wire import encode
        >>> s = SparseStream(torch.tensor([1, 5]), torch.tensor([1.0, 2.0]), 65536)
        >>> charge(encode(s), scale=4)  # 8 pairs of a 262144-vector: 3-byte indices
        Charge(nbytes=80, elements=8, dense=False)
    """
    if buf.numel() == 0:
        return Charge(0, 0, False)
    got = _stream_charge(buf, 0, scale)
    if got is not None:
        return got
    entries = peek_bundle(buf)
    if entries is None:
        return bytes_charge(buf, scale)
    nbytes, elements = float(entries[0][0] if entries else buf.numel()), 0.0
    for offset, length in entries:
        entry = _stream_charge(buf, offset, scale)
        if entry is None:
            nbytes += length * scale
        else:
            nbytes += entry.nbytes
            elements += entry.elements
    return Charge(nbytes, elements, False)


def _stream_charge(buf: torch.Tensor, offset: int, scale: int) -> Charge | None:
    h = peek(buf, offset)
    if h is None:
        return None
    if h.dense:
        return Charge(HEADER_BYTES + h.size * scale * h.value_bytes, h.size * scale, True)
    size, nnz = h.size * scale, h.nnz * scale
    if scale > 1 and nnz > dense_threshold_of(size, h.value_bytes):
        # past the full-size stream's dense switch (SparCML's delta, sec. 5.1), which
        # the scaled one, of narrower indices, had not reached: the full-size
        # message is dense
        return Charge(HEADER_BYTES + size * h.value_bytes, size, True)
    # the full-scale message's index field, coded as the small one was
    field = layout(size, nnz, elias_fano=h.elias_fano).nbytes
    return Charge(HEADER_BYTES + field + nnz * h.value_bytes, nnz, False)


def model_time(model: CostModel, algorithm: str, p: int, n: int, k: int, isize: int = 4) -> float:
    """The registered closed-form prediction for ``P`` ranks of ``k`` pairs."""
    return predict(model, algorithm, p, n, [k] * p, isize)


def _timed_calls(
    comm: SimCommunicator, cfg: SimConfig, call: Callable[[], SparseStream]
) -> tuple[SparseStream, list[float]]:
    """The last call's result and each of ``cfg.timed_calls`` calls' finish time, every
    call from clocks set to zero on every rank (after a warm-up call with measured
    compute: first calls pay one-time costs, as in ``sparcml bench``)."""
    if cfg.compute == "measured":
        call()
    finishes: list[float] = []
    out = SparseStream.empty(0)
    for _ in range(cfg.timed_calls):
        comm.reset_clock()  # making the data is not part of the collective
        out = call()
        comm.stop_clock()  # checking the result is not either
        finishes.append(comm.clock)
    return out, finishes


def _sparse_rank(comm: SimCommunicator, cfg: SimConfig, algorithm: str, n: int) -> Any:
    stream = gradient_like(n, cfg.density, comm.rank, overlap=cfg.overlap, seed=cfg.seed)
    fn = algorithm_info(algorithm).fn
    out, finishes = _timed_calls(comm, cfg, lambda: fn(stream, comm))
    return (*_digest(out, comm, finishes), None)


def _accumulator_rank(comm: SimCommunicator, cfg: SimConfig, algorithm: str, n: int) -> Any:
    """An algorithm that selects from the dense accumulator itself (Gaussiank, Ok-Topk)."""
    info = algorithm_info(algorithm)
    gen = torch.Generator().manual_seed(cfg.seed * 7_919 + 1_000_003 * (comm.rank + 1))
    options: dict[str, Any] = {"k": k_of(cfg.density, n)}
    refresh: float | None = None
    if "state" in info.options:
        if cfg.compute == "measured":
            # one untimed refresh first, on data of its own: a process's first calls
            # pay one-time costs (as in _timed_calls), which a period does not
            warm = torch.Generator().manual_seed(cfg.seed * 7_919 + 7 * (comm.rank + 1))
            first = SparseStream.dense(torch.randn(n, generator=warm))
            info.fn(first, comm, EXACT, k=options["k"], state=OkTopkState())
        options["state"] = OkTopkState()
        comm.reset_clock()
        # thresholds and boundaries: the first call of a period, timed on its own
        info.fn(SparseStream.dense(torch.randn(n, generator=gen)), comm, EXACT, **options)
        comm.stop_clock()
        refresh = comm.clock
    acc = SparseStream.dense(torch.randn(n, generator=gen))
    out, finishes = _timed_calls(comm, cfg, lambda: info.fn(acc, comm, EXACT, **options))
    return (*_digest(out, comm, finishes), refresh)


def _digest(
    s: SparseStream, comm: SimCommunicator, finishes: list[float]
) -> tuple[int, float, float, SparseStream | None, list[float]]:
    """Enough to tell results apart bit for bit, rank 0's whole result, the finish times."""
    keep = comm.rank == 0
    d = s.to_dense().double()
    pos = torch.arange(d.numel(), dtype=torch.float64)
    return s.nnz, float(d.sum()), float((d * pos).sum()), s if keep else None, finishes


def _call_times(results: Sequence[Any]) -> list[float]:
    """Each timed call's time: the slowest rank's finish."""
    return [max(f) for f in zip(*(r[4] for r in results), strict=True)]


def _reference(cfg: SimConfig, p: int, n: int) -> torch.Tensor:
    ref = torch.zeros(n, dtype=torch.float64)
    for r in range(p):
        s = gradient_like(n, cfg.density, r, overlap=cfg.overlap, seed=cfg.seed)
        ref.index_add_(0, s.indices, s.values.double())
    return ref


def run_simulation(cfg: SimConfig, model: CostModel | None = None) -> list[dict[str, Any]]:
    """Simulate every (P, algorithm) of ``cfg``; one dict per row (see the module docstring).

    ``model``: the cost model to use (default: ``cfg.calibration``'s, else the stored one).
    """
    cfg.validate()
    if model is None:
        model = CostModel.load(cfg.calibration) if cfg.calibration else CostModel.load()
    rows: list[dict[str, Any]] = []
    total = len(cfg.world_sizes) * len(cfg.algorithm_list())
    done = 0
    for p in cfg.world_sizes:
        s = cfg.scale_for(p)
        n = cfg.size // s
        ref: torch.Tensor | None = None
        for algorithm in cfg.algorithm_list():
            done += 1
            k_full = k_of(cfg.density, cfg.size)
            row: dict[str, Any] = {
                "P": p,
                "algorithm": algorithm,
                "N": cfg.size,
                "density": cfg.density,
                "scale": s,
                "sim_size": n,
                "expected_fill_in": expected_fill_in(cfg.size, [k_full] * p),
            }
            info = algorithm_info(algorithm)
            topo = cfg.topology(p)
            on_nodes = (
                model.for_topology(cfg.ranks_per_node) if topo and not topo.is_flat else model
            )
            row["model_s"] = (
                model_time(on_nodes, algorithm, p, cfg.size, k_full) if info.cost else None
            )
            if topo is not None:
                row["ranks_per_node"] = cfg.ranks_per_node
            if p > 1 and info.quadratic and p > cfg.quadratic_limit:
                row.update(source="model", time_s=row["model_s"])
                rows.append(row)
                _progress(cfg, done, total, row)
                continue
            mode: dict[str, Any] = {"compute": cfg.compute, "cpu_share": cfg.cpu_share(p)}
            rank_fn = _accumulator_rank if info.input == "accumulator" else _sparse_rank
            res = simulate_ranks(
                p, rank_fn, cfg, algorithm, n, model=model, scale=s, size=n, charge=charge,
                topology=topo, **mode,
            )  # fmt: skip
            digests = [r[:3] for r in res.results]
            identical = all(d == digests[0] for d in digests)
            correct: bool | None = None
            err: float | None = None
            if info.exact:
                if ref is None:
                    ref = _reference(cfg, p, n)
                got = res.results[0][3].to_dense().double()
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                correct = err < 1e-5
            refresh = [r[5] for r in res.results if r[5] is not None]
            if refresh:
                # a stateful top-k (Ok-Topk): the refresh call of each threshold period
                # on its own, and the period's mean per call
                tau = OkTopkState().tau_prime
                steady = statistics.median(_call_times(res.results))
                row["refresh_s"] = max(refresh)
                row["amortised_s"] = (max(refresh) + (tau - 1) * steady) / tau
            calls = _call_times(res.results)
            row.update(
                source="simulated",
                time_s=statistics.median(calls),
                calls_s=calls,
                bytes_sent_max=max(res.charged_bytes),
                messages_max=max(res.messages),
                result_nnz=res.results[0][0] * s,
                identical_on_all_ranks=identical,
                correct=correct,
                max_rel_error=err,
                wall_s=res.wall_s,
                compute_s_max=max(res.compute_s) if res.compute_s else 0.0,
            )
            if not identical or correct is False:
                raise AssertionError(
                    f"simulated {algorithm} at P={p}: results differ across ranks "
                    f"(identical={identical}) or from the dense sum (rel. error {err})"
                )
            rows.append(row)
            _progress(cfg, done, total, row)
    return rows


def _progress(cfg: SimConfig, done: int, total: int, row: dict[str, Any]) -> None:
    if not cfg.progress:
        return
    t = row["time_s"]
    wall = f", {row['wall_s']:.1f} s wall" if "wall_s" in row else ""
    shown = "n/a" if t is None else f"{t * 1e3:.1f} ms"
    print(
        f"[{done}/{total}] P={row['P']} {row['algorithm']}: {shown} ({row['source']}{wall})",
        file=sys.stderr,
        flush=True,
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.2f}"


def format_sim_table(rows: Sequence[dict[str, Any]], model: CostModel) -> str:
    """A markdown table of the rows, grouped by ``P``."""
    lines = [
        f"model: alpha {model.alpha * 1e6:.1f} us, beta {model.beta * 1e9:.3f} ns/B, "
        f"beta_sparse {(model.beta_sparse or model.beta) * 1e9:.3f} ns/B, "
        f"gamma {model.gamma * 1e9:.2f} ns/element ({model.source})",
        "",
        "| P | algorithm | source | time ms | model ms | sim/model | MB sent (max rank) "
        "| result nnz | E[K] (App. B) | scale s | wall s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, m = r["time_s"], r.get("model_s")
        ratio = "-" if t is None or not m or r["source"] == "model" else f"{t / m:.2f}"
        mb = f"{r['bytes_sent_max'] / 1e6:,.2f}" if "bytes_sent_max" in r else "-"
        nnz = f"{r['result_nnz']:,}" if "result_nnz" in r else "-"
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
        if "refresh_s" in r:
            wall += f" (refresh {_ms(r['refresh_s'])} ms, amortised {_ms(r['amortised_s'])} ms)"
        lines.append(
            f"| {r['P']} | {r['algorithm']} | {r['source']} | {_ms(t)} | {_ms(m)} | {ratio} "
            f"| {mb} | {nnz} | {r['expected_fill_in']:,.0f} | {r['scale']} | {wall} |"
        )
    return "\n".join(lines)


def plot_simulation(rows: Sequence[dict[str, Any]], path: Path, title: str) -> list[Path]:
    """Log-log plots: time vs P (simulated solid, model dashed) and bytes vs P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algs = sorted({r["algorithm"] for r in rows})
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, a in enumerate(algs):
        color = f"C{i}"
        sim = [r for r in rows if r["algorithm"] == a and r["source"] == "simulated"]
        mod = [r for r in rows if r["algorithm"] == a and r.get("model_s")]
        if sim:
            ax_t.plot([r["P"] for r in sim], [r["time_s"] for r in sim], "o-", color=color, label=a)
            ax_b.plot(
                [r["P"] for r in sim],
                [r["bytes_sent_max"] for r in sim],
                "o-",
                color=color,
                label=a,
            )
        if mod:
            ax_t.plot(
                [r["P"] for r in mod], [r["model_s"] for r in mod], "--", color=color, alpha=0.6
            )
    ps = sorted({r["P"] for r in rows if r["P"] > 1})
    if ps and rows:
        k = rows[0]["density"] * rows[0]["N"]
        ax_b.plot(ps, [6 * k * (p - 1) / p * 4 for p in ps], "k:", label="6k(P-1)/P words")
    ax_t.set(xscale="log", yscale="log", xlabel="P", ylabel="time [s]", title="time (-- model)")
    ax_b.set(xscale="log", yscale="log", xlabel="P", ylabel="bytes sent, largest rank")
    ax_t.set_xscale("log", base=2)
    ax_b.set_xscale("log", base=2)
    for ax in (ax_t, ax_b):
        ax.grid(True, which="both", alpha=0.3)
    ax_b.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def write_simulation(
    rows: Sequence[dict[str, Any]], cfg: SimConfig, out: Path, command: str
) -> list[Path]:
    """Write ``simulate.md`` (table and command), ``simulate.json``, ``simulate.png`` to ``out``."""
    model = CostModel.load(cfg.calibration) if cfg.calibration else CostModel.load()
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"simulated, N={cfg.size:,}, d={cfg.density:g}, overlap={cfg.overlap:g}"
        f" ({Path(model.source).name})"
    )
    md = out / "simulate.md"
    md.write_text(
        f"# {title}\n\nCommand: `{command}`\n\n{format_sim_table(rows, model)}\n\n"
        "![time and bytes vs P](simulate.png)\n"
    )
    js = write_json(
        out / "simulate.json",
        "simulate",
        [dict(r) for r in rows],
        dataclasses.asdict(cfg),
        command=command,
        model=dataclasses.asdict(model),
    )
    return [md, js, *plot_simulation(rows, out / "simulate.png", title)]


def validate_against(
    measured_json: Path,
    model: CostModel,
    quadratic_limit: int = 1024,
    compute: str = "model",
    cores: int | None = None,
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Simulate the configuration of a ``sparcml bench --json`` file; rows with both times.

    Uses the bench's own data generator, size, density, overlap and seed, at
    full scale (``s = 1``), so the simulated ranks send exactly the measured messages
    (a bench of several ``experiments`` is simulated for its first seed);
    ``repeats`` timed calls per row (their median against the bench's p50; None: the
    default of :attr:`SimConfig.timed_calls`). The simulator runs float32: a bench
    of another dtype is refused (ValueError). A row without a simulated or modelled
    time has ``error`` None.
    """
    data = json.loads(Path(measured_json).read_text())
    c = data["config"]
    p, n = int(c["world_size"]), int(c["size"])
    dtype = str(c.get("dtype", "float32"))
    if dtype != "float32":
        raise ValueError(f"{measured_json}: the bench ran {dtype}; the simulator runs float32 only")
    out = []
    for m in data["rows"]:
        a = m["algorithm"]
        if a not in algorithms():
            continue
        per = int(m.get("ranks_per_node", 1))
        cfg = SimConfig(
            world_sizes=(p,),
            size=n,
            density=float(c["density"]),
            overlap=float(c.get("overlap", 0.0)),
            algorithms=(a,),
            sim_elements=n * p,
            quadratic_limit=quadratic_limit,
            seed=int(c.get("seed", 0)),
            progress=False,
            compute=compute,
            cores=cores,
            ranks_per_node=per,
            repeats=repeats,
        )
        sim = run_simulation(cfg, model)[0]
        t = sim["time_s"]
        out.append(
            {
                "P": p,
                "algorithm": a,
                "measured_s": float(m["p50"]),
                "simulated_s": t,
                "simulated_calls_s": sim.get("calls_s"),
                "model_s": sim.get("model_s"),
                "error": None if t is None else t / float(m["p50"]) - 1.0,
            }
        )
    return out


def quadratic_cost_note(limit: int) -> str:
    return (
        f"P^2-work algorithms ({', '.join(a for a in algorithms() if algorithm_info(a).quadratic)})"
        f" are simulated up to P={limit}; "
        "beyond, their rows are the closed-form model"
    )
