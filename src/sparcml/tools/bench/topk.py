"""Top-k sparse allreduce benchmark: Ok-Topk against its baselines and dense (paper 001).

Every rank holds a dense accumulator of ``N`` Gaussian values and ``k =
density * N``. Timed per call (slowest rank, after a barrier, median of
``repeats`` after ``warmup``):

* ``dense`` — the backend's allreduce of the whole accumulator;
* ``topka``, ``topkdsa``, ``gtopk`` — on each rank's exact local top-k, selected
  once before timing (the selection time is reported on its own row);
* ``gaussiank`` and ``oktopk`` — from the accumulator, their own selection
  included (Ok-Topk keeps its state across the runs: thresholds and boundaries
  are reused as in training, ``tau = 64``, ``tau' = 32``).

Ok-Topk is also run over one full threshold period from a fresh state (``tau'``
calls, the accumulator drifting: ``acc * (1 + 0.05 t) + noise`` at call ``t``):
the row ``oktopk period`` is the mean per call with the refresh calls included,
``oktopk refresh`` the first call (threshold and boundaries computed) alone; its
``MB sent/rank`` is the largest of the period, against the ``6k(P-1)/P`` pair bound
(``bound_bytes``). ``topkdsa period`` runs TopkDSA on the same drifting vectors
with each rank's exact local top-k selected inside every timed call (what a
training step pays), the fair comparison for Ok-Topk's period.

Checks: ``dense`` against a float64 sum; ``topka``/``topkdsa`` against the sum of
the local top-k sets; ``gaussiank`` against the sum of each rank's Gaussian-k
selection; ``oktopk``: on its support the values equal the sum of the ranks'
selections at the thresholds it used, and its size lies in [k/2, 2k]; every
algorithm: the same result on every rank (checksums compared).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch

from ...collectives import OkTopkState, sparse_allreduce
from ...collectives.registry import algorithm_info, algorithms, predict
from ...comm import Communicator
from ...comm.launch import run_processes
from ...compress.gaussiank import GaussianK
from ...compress.selection import k_of
from ...compress.topk import TopK
from ...costmodel import CostModel
from ...stream import SparseStream, index_bytes
from .harness import Case, percentiles, time_case

__all__ = ["TopkBenchConfig", "run_topk_benchmark"]


def topk_algorithms() -> list[str]:
    """Ok-Topk's comparison, from the registry (family ``"topk"``), dense first."""
    return sorted(algorithms(family="topk"), key=lambda a: (a != "dense", a))


@dataclasses.dataclass(frozen=True)
class TopkBenchConfig:
    """What to run (attribute names shared with :class:`~sparcml.tools.bench.BenchConfig`)."""

    world_size: int = 4
    size: int = 1 << 24
    density: float = 0.01
    repeats: int = 5
    warmup: int = 1
    seed: int = 0
    timeout: float = 300.0
    progress: bool = True
    overlap: float = 0.0
    dtype: str = "float32"
    experiments: int = 1

    def validate(self) -> None:
        if self.world_size < 1 or self.size < 1:
            raise ValueError("world size and N must be at least 1")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must lie in (0, 1], got {self.density}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")


def _checksum(comm: Communicator, s: SparseStream) -> bool:
    """True on every rank iff every rank holds the same result (two float64 sums)."""
    d = s.to_dense().double()
    pos = torch.arange(d.numel(), dtype=torch.float64)
    v = torch.stack([d.sum(), (d * pos).sum()])
    hi, lo = comm.allreduce(v, op="max"), comm.allreduce(v, op="min")
    return bool(torch.equal(hi, lo))


def _rel_err(got: SparseStream, ref: torch.Tensor, scale: torch.Tensor) -> float:
    err = (got.to_dense().double() - ref).abs()
    return float((err / scale.clamp_min(1e-30)).max()) if err.numel() else 0.0


class Period(NamedTuple):
    """What :func:`oktopk_period` measured."""

    times: list[float]
    sent: list[int]
    cpu: list[float]
    err: float
    nnz: int


def oktopk_period(
    comm: Communicator,
    acc: torch.Tensor,
    k: int,
    seed: int,
    tau_prime: int | None = None,
    algorithm: str = "oktopk",
) -> Period:
    """One threshold period (``tau_prime`` calls, default the state's) from a fresh
    state, the accumulator drifting: ``acc * (1 + 0.05 t) + noise`` at call ``t``.

    ``algorithm="oktopk"``: Ok-Topk from the accumulator (call 0 is the refresh).
    Any other top-k algorithm that takes a selection (``topkdsa``, ...) runs on the
    same vectors with each rank's exact local top-k selected inside the timed call,
    as a training step would.

    Returns the slowest rank's seconds, this rank's bytes sent and the busiest rank's
    CPU seconds, per call, the largest relative error of any call's result against
    its float64 reference (checked after the timed call, outside it) and the last
    result's number of nonzeros.
    """
    state = OkTopkState() if tau_prime is None else OkTopkState(tau_prime=tau_prime)
    g = torch.Generator().manual_seed(seed * 7919 + 104_729 + comm.rank)
    select = TopK(k=k)
    times: list[float] = []
    sent: list[int] = []
    cpu: list[float] = []
    err = 0.0
    for t in range(state.tau_prime):
        x = acc * (1 + 0.05 * t) + torch.randn(acc.numel(), generator=g)
        comm.barrier()
        before = comm.stats.bytes_sent
        c, t0 = time.process_time(), time.perf_counter()
        if algorithm == "oktopk":
            r = sparse_allreduce(SparseStream.dense(x), comm, algorithm="oktopk", k=k, state=state)
        else:
            r = sparse_allreduce(select.select(x), comm, algorithm=algorithm)
        el, used = time.perf_counter() - t0, time.process_time() - c
        sent.append(comm.stats.bytes_sent - before)
        worst = comm.allreduce(torch.tensor([el, used], dtype=torch.float64), op="max")
        times.append(float(worst[0]))
        cpu.append(float(worst[1]))
        if algorithm == "oktopk":
            assert state.local_threshold is not None
            err = max(err, oktopk_error(comm, x, r, state.local_threshold))
        else:  # an exact algorithm: the sum of every rank's local top-k
            mine = select.select(x).to_dense().double()
            err = max(err, _rel_err(r, comm.allreduce(mine), comm.allreduce(mine.abs())))
    return Period(times, sent, cpu, err, r.count_nonzero())


def oktopk_error(
    comm: Communicator, x: torch.Tensor, result: SparseStream, t_local: float
) -> float:
    """Ok-Topk's result against the float64 sum of every rank's entries at or above
    its local threshold, on the result's support (the global threshold picks the
    support; what it keeps must be that sum)."""
    mine = (x.abs() >= t_local).double() * x.double()
    ref, scale = comm.allreduce(mine), comm.allreduce(mine.abs())
    support = result.indices if not result.is_dense else torch.arange(x.numel())
    if not support.numel():
        return 0.0
    diff = (result.to_dense().double() - ref).abs()[support]
    return float((diff / scale[support].clamp_min(1e-30)).max())


def rank_main(comm: Communicator, cfg: TopkBenchConfig) -> list[dict[str, Any]] | None:
    n, p = cfg.size, comm.world_size
    k = k_of(cfg.density, n)
    g = torch.Generator().manual_seed(cfg.seed * 7919 + comm.rank)
    acc = torch.randn(n, generator=g)
    show = cfg.progress and comm.rank == 0

    # Selection happens once, outside the timing, for the algorithms that take it;
    # its own row is the median of three calls after that first one (which loads
    # the compiled kernels), the slowest rank's
    local = TopK(k=k).select(acc)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        TopK(k=k).select(acc)
        times.append(time.perf_counter() - t0)
    select_s = float(comm.allreduce(torch.tensor([sorted(times)[1]]), op="max"))
    # the selection's magnitudes against torch.topk's (ties may pick other positions)
    want = torch.topk(acc.abs(), k, sorted=True).values
    got = torch.sort(local.values.abs(), descending=True).values
    select_err = (
        float((got - want).abs().max() / want[0].clamp_min(1e-30))
        if got.shape == want.shape and k
        else math.inf
    )
    select_err = float(comm.allreduce(torch.tensor([select_err]), op="max"))
    gauss_local = GaussianK(k=k).select(acc)
    dense_ref = comm.allreduce(acc.double())
    scale_all = comm.allreduce(acc.double().abs())
    topk_ref = comm.allreduce(local.to_dense().double())
    topk_scale = comm.allreduce(local.to_dense().double().abs())
    gauss_ref = comm.allreduce(gauss_local.to_dense().double())
    gauss_scale = comm.allreduce(gauss_local.to_dense().double().abs())
    states: dict[str, OkTopkState] = {}
    names = topk_algorithms()

    def run(name: str) -> SparseStream:
        info = algorithm_info(name)
        if name == "dense":  # the backend's allreduce itself, no consistency check
            return SparseStream.dense(comm.allreduce(acc))
        if info.input == "selection":
            return sparse_allreduce(local, comm, algorithm=name)
        if info.input == "accumulator":
            options: dict[str, Any] = {"k": k}
            if "state" in info.options:  # kept across the runs, as in training
                options["state"] = states.setdefault(name, OkTopkState())
            return sparse_allreduce(SparseStream.dense(acc), comm, algorithm=name, **options)
        return sparse_allreduce(SparseStream.dense(acc), comm, algorithm=name)

    rows: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names, 1):
        timing = time_case(comm, Case(name, lambda name=name: run(name)), cfg.warmup, cfg.repeats)
        times, sent, result = timing.times, timing.sent, timing.result
        same = _checksum(comm, result)
        if name == "dense":
            err = _rel_err(result, dense_ref, scale_all)
            ok = err <= 1e-5
        elif algorithm_info(name).exact:  # the sum of its inputs
            ref, scale = (
                (topk_ref, topk_scale)
                if algorithm_info(name).input == "selection"
                else (dense_ref, scale_all)
            )
            err = _rel_err(result, ref, scale)
            ok = err <= 1e-5
        elif name == "gaussiank":
            err = _rel_err(result, gauss_ref, gauss_scale)
            ok = err <= 1e-5
        elif name == "oktopk":
            t_local = states[name].local_threshold
            assert t_local is not None
            err = oktopk_error(comm, acc, result, t_local)
            ok = err <= 1e-5 and k / 2 <= result.count_nonzero() <= 2 * k
        elif name == "gtopk":  # lossy by design (at most k entries): its error in norm
            ref_norm = float(topk_ref.double().norm())
            err = float((result.to_dense().double() - topk_ref.double()).norm()) / max(
                ref_norm, 1e-30
            )
            ok = result.count_nonzero() <= k and math.isfinite(err)
        else:  # a registered top-k algorithm this benchmark has no check for
            err = float("nan")
            ok = same
        ok_all = bool(comm.allreduce(torch.tensor([int(ok and same)]), op="min"))
        mean_sent = float(comm.allreduce(torch.tensor([statistics.fmean(sent)]))) / p
        p25, p50, p75 = percentiles(times)
        rows[name] = {
            "algorithm": name,
            "p25": p25,
            "p50": p50,
            "p75": p75,
            "bytes_sent": mean_sent,
            "result_nnz": result.count_nonzero(),
            "result_dense": result.is_dense,
            "max_rel_error": err,
            "correct": ok_all,
            "chose": None,
            "inexact": name == "gtopk",
            "cpu_p50": statistics.median(timing.cpu),
        }
        if show:
            print(
                f"  [{i}/{len(names)}] {name:<10} {rows[name]['p50'] * 1e3:9.2f} ms  "
                f"{'ok' if ok_all else 'WRONG'}",
                file=sys.stderr,
                flush=True,
            )
    if "oktopk" in names:
        period = oktopk_period(comm, acc, k, cfg.seed)
        times, sent, cpu, ok_err = period.times, period.sent, period.cpu, period.err
        most = int(comm.allreduce(torch.tensor([max(sent)]), op="max"))
        bound = 6 * k * (p - 1) / p * (index_bytes(n) + 4)  # pairs: index + float32
        # TopkDSA on the same drifting vectors, its exact local top-k in every call
        dsa = oktopk_period(comm, acc, k, cfg.seed, algorithm="topkdsa")
        d_times, d_sent, d_cpu, d_err = dsa.times, dsa.sent, dsa.cpu, dsa.err
        d_most = int(comm.allreduce(torch.tensor([max(d_sent)]), op="max"))
        rows[f"topkdsa period ({len(d_times)} calls)"] = {
            "algorithm": f"topkdsa period ({len(d_times)} calls)",
            "p25": statistics.fmean(d_times),
            "p50": statistics.fmean(d_times),
            "p75": statistics.fmean(d_times),
            "bytes_sent": float(d_most),
            "result_nnz": dsa.nnz,
            "result_dense": False,
            "max_rel_error": d_err,
            "correct": d_err <= 1e-5,
            "chose": None,
            "cpu_p50": statistics.fmean(d_cpu),
            "period_times": d_times,
        }
        for label, ts, cs in (
            (f"oktopk period ({len(times)} calls)", times, cpu),
            ("oktopk refresh", times[:1], cpu[:1]),
        ):
            rows[label] = {
                "algorithm": label,
                "p25": statistics.fmean(ts),
                "p50": statistics.fmean(ts),
                "p75": statistics.fmean(ts),
                "bytes_sent": float(most),
                "bytes_sent_max": most,
                "bound_bytes": bound,
                "result_nnz": period.nnz,
                "result_dense": False,
                "max_rel_error": ok_err,
                "correct": ok_err <= 1e-5 and most <= bound,
                "chose": None,
                "cpu_p50": statistics.fmean(cs),
                "period_times": ts,
            }
        if show:
            print(
                f"  oktopk period: {statistics.fmean(times) * 1e3:.2f} ms/call, refresh "
                f"{times[0] * 1e3:.2f} ms, max {most / 1e6:.3f} MB/rank (bound {bound / 1e6:.3f}); "
                f"topkdsa with its local top-k on the same vectors "
                f"{statistics.fmean(d_times) * 1e3:.2f} ms/call",
                file=sys.stderr,
                flush=True,
            )
    if comm.rank != 0:
        return None
    out = list(rows.values())
    model = CostModel.load()
    for r in out:
        r["speedup_vs_dense"] = rows["dense"]["p50"] / r["p50"]
        r["algbw_gbps"] = n * 4 / r["p50"] / 1e9 if r["p50"] > 0 else 0.0
        r["busbw_gbps"] = r["algbw_gbps"] * 2 * (p - 1) / p
        # the registered alpha-beta-gamma formula for k pairs per rank
        registered = r["algorithm"] in algorithms()
        has_cost = registered and algorithm_info(r["algorithm"]).cost is not None
        r["predicted"] = predict(model, r["algorithm"], p, n, [k] * p, 4) if has_cost else None
    out.append(
        {
            "algorithm": "(exact local top-k)",
            "p25": select_s,
            "p50": select_s,
            "p75": select_s,
            "bytes_sent": 0.0,
            "result_nnz": local.nnz,
            "result_dense": False,
            "max_rel_error": select_err,
            "correct": select_err <= 1e-6 and local.nnz == k,
            "chose": None,
            "speedup_vs_dense": None,
        }
    )
    return out


def run_topk_benchmark(cfg: TopkBenchConfig) -> list[dict[str, Any]]:
    """Spawn ``cfg.world_size`` local gloo ranks and run the benchmark; rank 0's rows."""
    cfg.validate()
    out = run_processes(
        cfg.world_size, rank_main, cfg, timeout=cfg.timeout, deadline=cfg.timeout * 20
    )
    assert out[0] is not None
    return out[0]
