"""Time to accuracy: a recipe's methods compared by training time and bytes to a target.

The target is the dense float32 run's final figure (``ddp``, plain DDP, else
sparcml's ``dense``): the time each method's training clock shows at the first
evaluation that reaches it, and at the first that comes within one point of
accuracy (perplexity: within 3%). Speedups are over dense float32 and over the
best of PyTorch's hooks (``fp16``, ``bf16``, ``powersgd*``) for the same target.

The step split: ``compute`` is a forward + backward pass without synchronisation
(measured after training, every pass started on all ranks together, as in
training; the slowest rank's time of each pass, so the wait for the rank whose
backward ends last counts as compute), ``optimizer`` the optimizer step, ``sync``
the rest of a step (compression, communication and the waits they cause);
``wire`` is what the bytes one rank sends cost at
the link rate alone (bytes / rate, TCP/IP and Ethernet headers counted:
:data:`FRAMING`), the floor of the communication.

:func:`run_on_cluster` runs every method as its own job on a fresh emulated
cluster (:mod:`sparcml.tools.cluster`) and gathers the runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cluster import parse_rate

__all__ = [
    "baseline_method",
    "format_predictions",
    "format_tta_table",
    "load_result",
    "parse_rate",
    "predict_rows",
    "run_on_cluster",
    "targets",
    "time_to",
    "tta_rows",
    "wire_ms",
    "write_tta_report",
]

log = logging.getLogger("sparcml.train")

HOOKS = ("fp16", "bf16")


def is_hook(method: str) -> bool:
    return method in HOOKS or method.startswith("powersgd")


def baseline_method(result: dict[str, Any]) -> str | None:
    runs = result["runs"]
    return "ddp" if "ddp" in runs else ("dense" if "dense" in runs else None)


def targets(result: dict[str, Any]) -> tuple[float, float] | None:
    """The dense run's final figure and the "within" target (1 point; perplexity 3%),
    or the target the runs stopped at (``--target``, or the one ``--stop-after`` took
    from the baseline), which a baseline stopped early may have passed by more."""
    base = baseline_method(result)
    if base is None:
        return None
    final = float(result["runs"][base]["evals"][-1][result["metric"]])
    given = (result.get("options") or {}).get("target")
    if given is not None:
        return final, float(given)
    if result["higher_is_better"]:
        return final, final - 0.01
    return final, final * 1.03


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target - 1e-12 if higher else value <= target + 1e-12


def time_to(run: dict[str, Any], metric: str, target: float, higher: bool) -> float | None:
    """Training seconds at the first evaluation reaching ``target`` (None: never)."""
    for e in run["evals"]:
        if metric in e and _reached(float(e[metric]), target, higher):
            return float(e["train_s"])
    return None


def steps_to(run: dict[str, Any], metric: str, target: float, higher: bool) -> int | None:
    """Training steps at the first evaluation reaching ``target`` (None: never)."""
    for e in run["evals"]:
        if metric in e and _reached(float(e[metric]), target, higher):
            return int(e["step"])
    return None


def bytes_to(run: dict[str, Any], metric: str, target: float, higher: bool) -> float | None:
    """Bytes one rank sent up to the first evaluation reaching ``target``."""
    for e in run["evals"]:
        if metric in e and _reached(float(e[metric]), target, higher):
            return float(sum(run["step_bytes"][: int(e["step"])]))
    return None


def _warm(run: dict[str, Any]) -> int:
    h = run.get("hyper", {})
    return int(h.get("warmup_steps", h.get("start_iter", 0)) or 0)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def tta_rows(result: dict[str, Any], rate_bps: float | None = None) -> list[dict[str, Any]]:
    """One row per method: final figure, times and bytes to the targets, speedups, step split.

    Step figures are means over the steps after any dense warm-up (over all steps
    when the warm-up covers the run).
    """
    metric, higher = result["metric"], result["higher_is_better"]
    tg = targets(result)
    rows: list[dict[str, Any]] = []
    for method, run in result["runs"].items():
        warm = _warm(run)
        steps = run["step_times"]
        after = slice(warm, None) if warm < len(steps) else slice(None)
        step_s = _mean(steps[after])
        opt_s = _mean(run.get("opt_times", [])[after]) if run.get("opt_times") else 0.0
        compute_s = run.get("compute_s")
        bytes_step = _mean(run["step_bytes"][after])
        row: dict[str, Any] = {
            "method": method,
            metric: float(run["evals"][-1][metric]),
            "best": (max if higher else min)(float(e[metric]) for e in run["evals"] if metric in e),
            "train_s": float(run.get("train_s", sum(steps))),
            "steps": len(steps),
            "warmup_steps": warm,
            "ms_per_step": 1000 * step_s,
            "compute_ms": 1000 * compute_s if compute_s is not None else None,
            "optimizer_ms": 1000 * opt_s,
            "sync_ms": (
                1000 * max(0.0, step_s - compute_s - opt_s) if compute_s is not None else None
            ),
            "bytes_per_step": bytes_step,
            "wire_ms": wire_ms(bytes_step, rate_bps) if rate_bps else None,
            "messages_per_step": run.get("messages_per_step"),
            "total_bytes": float(sum(run["step_bytes"])),
        }
        row["overhead_ms"] = overhead_ms(row)
        if tg is not None:
            row["to_final_s"] = time_to(run, metric, tg[0], higher)
            row["to_within_s"] = time_to(run, metric, tg[1], higher)
            row["steps_to_within"] = steps_to(run, metric, tg[1], higher)
            row["bytes_to_within"] = bytes_to(run, metric, tg[1], higher)
        rows.append(row)
    if tg is not None:
        base = baseline_method(result)
        by = {r["method"]: r for r in rows}
        t_dense = by[base]["to_within_s"] if base else None
        hook_times = [r["to_within_s"] for r in rows if is_hook(r["method"]) and r["to_within_s"]]
        t_hook = min(hook_times) if hook_times else None
        best_hook = next(
            (r["method"] for r in rows if is_hook(r["method"]) and r["to_within_s"] == t_hook),
            None,
        )
        for r in rows:
            t = r["to_within_s"]
            r["speedup_vs_dense"] = t_dense / t if t and t_dense else None
            r["speedup_vs_best_hook"] = t_hook / t if t and t_hook else None
            r["best_hook"] = best_hook
    return rows


#: the latency of one message on the emulated links (the cost model's default alpha)
ALPHA_S = 50e-6
#: bytes on the shaped link per byte of TCP payload: a 1500-byte MTU carries 1448
#: payload bytes (20 IPv4 + 20 TCP + 12 timestamp option) in 1514 bytes at the
#: shaper (tc counts the 14-byte Ethernet header); acknowledgements go the other way
FRAMING = 1514 / 1448


def wire_ms(nbytes: float, rate_bps: float) -> float:
    """Milliseconds ``nbytes`` of payload take on a link of ``rate_bps``, TCP/IP and
    Ethernet headers counted (:data:`FRAMING`)."""
    return 1000 * nbytes * FRAMING * 8 / rate_bps


def overhead_ms(row: dict[str, Any]) -> float | None:
    """A step's sync beyond its link time: sync minus bytes / rate minus messages x
    alpha (:data:`ALPHA_S`; PyTorch's hooks count no messages, their latency stays in
    the figure). What a lean step removes: selection, error feedback, encoding,
    copies and the hand-off to the transport. (The wait for the rank whose backward
    ends last is compute: :func:`sparcml.tools.recipes.train.compute_split`.)"""
    if row.get("sync_ms") is None or row.get("wire_ms") is None:
        return None
    latency = 1000 * ALPHA_S * (row.get("messages_per_step") or 0.0)
    return row["sync_ms"] - row["wire_ms"] - latency


def predict_ms(row: dict[str, Any], rate_bps: float) -> float | None:
    """The time per step ``row``'s method would take on a link of ``rate_bps``: its
    measured compute, optimizer step and overhead (:func:`overhead_ms`, local work
    that does not depend on the link), plus its bytes per step at that rate and its
    messages' latency."""
    over = row.get("overhead_ms")
    if over is None or row.get("compute_ms") is None:
        return None
    latency = 1000 * ALPHA_S * (row.get("messages_per_step") or 0.0)
    wire = wire_ms(row["bytes_per_step"], rate_bps)
    return row["compute_ms"] + row["optimizer_ms"] + max(over, 0.0) + wire + latency


def predict_rows(
    result: dict[str, Any], rate_bps: float, rates: Sequence[str]
) -> list[dict[str, Any]]:
    """Per method, the predicted time per step at each of ``rates`` (tc syntax) and
    the predicted time to the "within" target (steps to it, counted where the run
    reached it, times the predicted step; the dense warm-up steps at the dense
    baseline's predicted step)."""
    rows = tta_rows(result, rate_bps)
    by = {r["method"]: r for r in rows}
    base = by.get(baseline_method(result) or "")
    out = []
    for r in rows:
        pred: dict[str, Any] = {"method": r["method"], "steps_to_within": r.get("steps_to_within")}
        for rate in rates:
            bps = parse_rate(rate)
            step = predict_ms(r, bps)
            pred[f"ms_per_step@{rate}"] = step
            n = r.get("steps_to_within")
            if step is None or n is None:
                pred[f"s_to_within@{rate}"] = None
                continue
            warm = min(r["warmup_steps"], n)
            dense_step = predict_ms(base, bps) if base is not None else None
            warm_ms = warm * (dense_step if dense_step is not None else step)
            pred[f"s_to_within@{rate}"] = (warm_ms + (n - warm) * step) / 1000
        out.append(pred)
    return out


def format_predictions(result: dict[str, Any], rate_bps: float, rates: Sequence[str]) -> str:
    """:func:`predict_rows` as a Markdown table, with the method to use at each rate
    (the least predicted time to the target)."""
    preds = predict_rows(result, rate_bps, rates)
    head = "| method | steps to within | " + " | ".join(
        f"ms/step @ {r} | s to within @ {r}" for r in rates
    )
    lines = [head + " |", "|---|---:|" + "---:|---:|" * len(rates)]
    for p in preds:
        cells = []
        for r in rates:
            cells += [_ms(p[f"ms_per_step@{r}"]), _s(p[f"s_to_within@{r}"])]
        n = p["steps_to_within"]
        steps = "never" if n is None else str(n)
        lines.append(f"| {p['method']} | {steps} | " + " | ".join(cells) + " |")
    best = []
    for r in rates:
        timed = [(p[f"s_to_within@{r}"], p["method"]) for p in preds if p[f"s_to_within@{r}"]]
        best.append(f"{r}: {min(timed)[1]}" if timed else f"{r}: -")
    lines += ["", "Use (least predicted time to within the target): " + "; ".join(best) + "."]
    return "\n".join(lines)


def _fmt_metric(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.2f}%" if metric == "accuracy" else f"{v:.3f}"


def _s(v: float | None, spec: str = ".1f") -> str:
    return "never" if v is None else format(v, spec)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def format_tta_table(result: dict[str, Any], rate_bps: float | None = None) -> str:
    """Two Markdown tables: time to accuracy with speedups, and the time per step split."""
    metric = result["metric"]
    rows = tta_rows(result, rate_bps)
    tg = targets(result)
    within = "1 point" if result["higher_is_better"] else "3%"
    out = []
    if tg is not None:
        out += [
            f"Target: dense fp32 ({baseline_method(result)}) final test {metric} "
            f"{_fmt_metric(metric, tg[0])}; within {within}: {_fmt_metric(metric, tg[1])}. "
            "Times are training seconds (evaluations excluded), at the first evaluation "
            "reaching the target.",
            "",
            f"| method | final {metric} | s to within {within} | steps to within "
            "| s to dense final | MB sent to within (per rank) | vs dense fp32 "
            "| vs best PyTorch hook | training s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            mb = r["bytes_to_within"]
            n = r["steps_to_within"]
            out.append(
                f"| {r['method']} | {_fmt_metric(metric, r[metric])} | {_s(r['to_within_s'])} "
                f"| {'never' if n is None else n} "
                f"| {_s(r['to_final_s'])} | {'-' if mb is None else f'{mb / 1e6:.1f}'} "
                f"| {_x(r['speedup_vs_dense'])} | {_x(r['speedup_vs_best_hook'])} "
                f"| {r['train_s']:.1f} |"
            )
        out.append("")
    out += [
        "| method | ms per step | compute (fwd+bwd, slowest rank) | optimizer "
        "| sync (compress + comm + wait) "
        "| wire: bytes (+ headers) / link rate | sync beyond the link | messages per step "
        "| bytes per step (per rank) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        msgs = r.get("messages_per_step")
        out.append(
            f"| {r['method']} | {_ms(r['ms_per_step'])} | {_ms(r['compute_ms'])} "
            f"| {_ms(r['optimizer_ms'])} | {_ms(r['sync_ms'])} | {_ms(r['wire_ms'])} "
            f"| {_ms(r['overhead_ms'])} | {'-' if msgs is None else f'{msgs:.1f}'} "
            f"| {r['bytes_per_step']:,.0f} |"
        )
    return "\n".join(out)


def _links_line(result: dict[str, Any]) -> list[str]:
    """How the emulated links were shaped (``sparcml cluster``), as a report's line."""
    if not result.get("link"):
        return []
    return [f'Links: {result["link"]} (docs/cluster.md, "The token bucket\'s burst")', ""]


def _steal_lines(
    steal: dict[str, float | None], what: str = "CPU steal during each run"
) -> list[str]:
    """The report's lines on the host's steal (``/proc/stat``), flagged past
    :data:`~sparcml.tools.bench.harness.STEAL_FLAG`; none without readings."""
    from ..bench.harness import STEAL_FLAG

    known = {k: v for k, v in steal.items() if v is not None}
    if not known:
        return []
    lines = [
        f"{what} (CPU time the host gave to other work while this machine's cores had "
        "work; the load average does not show it): "
        + "; ".join(f"{k} {100 * v:.1f}%" for k, v in known.items()),
        "",
    ]
    contended = [k for k, v in known.items() if v > STEAL_FLAG]
    if contended:
        lines += [
            f"**Contended host** ({', '.join(contended)}: more than {100 * STEAL_FLAG:g}% "
            "steal): those times are slower than the machine's own; compare runs made on "
            "a quiet host.",
            "",
        ]
    return lines


def write_tta_report(
    result: dict[str, Any],
    out: Path,
    command: str,
    rate_bps: float | None = None,
    predict: Sequence[str] = (),
) -> list[Path]:
    """``results.json`` (runs, rows, machine, rate, command, versions), ``summary.csv``,
    ``results.md`` and ``tta.png`` (figure against training seconds and against MB);
    ``predict``: link rates (tc syntax) for :func:`format_predictions` in results.md."""
    from ..bench.harness import write_csv, write_json

    out.mkdir(parents=True, exist_ok=True)
    rows = tta_rows(result, rate_bps)
    config = {k: v for k, v in result.items() if k != "runs"}
    doc = write_json(
        out / "results.json", "train-tta", result["runs"], config, command=command,
        summary=rows, link_rate_bps=rate_bps, **config,
    )  # fmt: skip
    written = [doc]
    written.append(write_csv(out / "summary.csv", rows))
    rate = result.get("link_rate") or "loopback"
    md = [
        f"# {result['recipe']}: P = {result['world']}, {rate} links, {result['epochs']} epoch(s)",
        "",
        *_links_line(result),
        f"Command: `{command}`",
        "",
        "Hyperparameters per method: "
        + "; ".join(
            f"{m}: {r.get('peer_hyper') or r.get('hyper', {})}" for m, r in result["runs"].items()
        ),
        "",
        format_tta_table(result, rate_bps),
        "",
    ]
    if predict and rate_bps:
        md += [
            f"Predicted for other links (measured at {rate}: compute, optimizer step and "
            "the sync beyond the link kept, bytes and messages costed at each rate):",
            "",
            format_predictions(result, rate_bps, predict),
            "",
        ]
    if result.get("exit_codes"):
        md += [
            "Kept, though the job exited non-zero after rank 0 wrote the run (a rank "
            "aborted in teardown): "
            + "; ".join(f"{m}: exit code {c}" for m, c in result["exit_codes"].items()),
            "",
        ]
    if result.get("failed"):
        md += [
            "Failed (no result): " + "; ".join(f"{m}: {w}" for m, w in result["failed"].items()),
            "",
        ]
    order = result.get("run_order")
    if order and order != list(result["runs"]):
        md += ["Run in this order (rotated per seed): " + ", ".join(order), ""]
    loads = {m: r["loadavg"] for m, r in result["runs"].items() if r.get("loadavg")}
    if loads:
        md += [
            "Load average of the machine (1 / 5 / 15 min) when each run ended, all work on "
            "its cores counted: "
            + "; ".join(f"{m} {' / '.join(f'{x:.1f}' for x in v)}" for m, v in loads.items()),
            "",
        ]
    md += _steal_lines({m: r.get("cpu_steal") for m, r in result["runs"].items()})
    (out / "results.md").write_text("\n".join(md))
    written.append(out / "results.md")
    from .train import pyplot

    plt = pyplot()
    if plt is None:  # plots need the bench extra
        return written
    metric = result["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, run in result["runs"].items():
        ev = [e for e in run["evals"] if metric in e]
        ys = [float(e[metric]) for e in ev]
        cum = [sum(run["step_bytes"][: int(e["step"])]) / 1e6 for e in ev]
        style = "--" if method in ("ddp", "dense") or is_hook(method) else "-"
        axes[0].plot([e["train_s"] for e in ev], ys, style, marker=".", label=method)
        sent = [(c, y) for c, y in zip(cum, ys, strict=True) if c > 0]  # log axis: no 0
        axes[1].plot([c for c, _ in sent], [y for _, y in sent], style, marker=".", label=method)
    tg = targets(result)
    for ax in axes:
        if tg is not None:
            ax.axhline(tg[1], color="grey", lw=0.8, ls=":")
        ax.set_ylabel(f"test {metric}")
        ax.grid(alpha=0.3)
    if tg is not None:
        lo, hi = sorted((tg[1], tg[0]))
        span = abs(tg[0] - tg[1])
        for ax in axes:
            ax.set_ylim(lo - 8 * span, hi + 3 * span) if result["higher_is_better"] else (
                ax.set_ylim(lo - 3 * span, hi + 12 * span)
            )
    axes[0].set_xlabel("training seconds (evaluations excluded)")
    axes[1].set_xlabel("MB sent per rank (log)")
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['recipe']}, P = {result['world']}, {rate} links")
    fig.tight_layout()
    fig.savefig(out / "tta.png", dpi=100)
    plt.close(fig)
    written.append(out / "tta.png")
    return written


def load_result(path: str | Path) -> dict[str, Any]:
    """The result a ``results.json`` of :func:`write_tta_report` was written from."""
    doc = json.loads(Path(path).read_text())
    result = dict(doc["config"])
    result["runs"] = doc["rows"]
    return result


def rotated(methods: Sequence[str], places: int, keep_first: bool = False) -> list[str]:
    """``methods`` rotated left by ``places`` (the first kept in place with
    ``keep_first``: the baseline whose final figure sets the target).

    Example:
        >>> rotated(["ddp", "a", "b", "c"], 1, keep_first=True)
        ['ddp', 'b', 'c', 'a']
    """
    head, rest = (list(methods[:1]), list(methods[1:])) if keep_first else ([], list(methods))
    if not rest:
        return head
    k = places % len(rest)
    return head + rest[k:] + rest[:k]


def run_on_cluster(
    recipe: str,
    methods: Sequence[str],
    hosts: int,
    rate: str,
    child_args: Sequence[str],
    timeout: float | None = None,
    log_dir: str | Path | None = None,
    stop_after: int = 0,
    target: float | None = None,
    ranks_per_node: int = 1,
    rotate: int = 0,
) -> dict[str, Any]:
    """Run each method as its own job on a fresh ``hosts``-rank cluster at ``rate``
    (``hosts / ranks_per_node`` hosts of ``ranks_per_node`` ranks sharing one NIC).

    ``rotate``: the methods after the baseline (all of them when no baseline runs
    first) run in their order rotated by this many places (``--seeds`` passes the
    seed's position), so that a drift of the machine over a job (its load, another
    tenant) does not fall on the same method in every seed. A precaution: two jobs
    with the order reversed found no effect of the order beyond the noise
    (docs/training.md). The result lists the runs in the order given;
    ``run_order`` says the order they ran in.

    ``stop_after``: a method stops once that many evaluations in a row reached
    ``target`` (default: the "within" figure of the dense baseline, which then runs
    first and whole).

    Every host runs ``python -m sparcml.tools.cli train RECIPE --env --methods M
    CHILD_ARGS``; rank 0 writes its run to a temporary file, gathered here.

    A method whose job fails or times out is logged and listed under ``failed``;
    the others still run.

    Raises:
        sparcml.tools.cluster.ClusterError: the cluster could not be set up (root?).
        RuntimeError: every job failed.
    """
    from ..cluster import run_on_cluster as run_job
    from . import RECIPES
    from .data import data_dir
    from .train import stop_order, within_target

    RECIPES[recipe].check_data()
    if ranks_per_node < 1 or hosts % ranks_per_node:
        raise ValueError(f"{hosts} ranks cannot form hosts of {ranks_per_node} ranks each")
    recipe_cls = RECIPES[recipe]
    listed = stop_order(list(methods), {"stop_after": stop_after, "target": target})
    # the run whose final figure sets the target: the baseline stop_order put first
    # (a later method never does: were the baseline's job to fail, the rest run whole)
    baseline = listed[0] if stop_after and target is None else None
    methods = rotated(listed, rotate, keep_first=baseline is not None)
    parse_rate(rate)
    env_data = os.environ.get("SPARCML_DATA")
    os.environ["SPARCML_DATA"] = str(Path(env_data or data_dir()).resolve())
    merged: dict[str, Any] | None = None
    failed: dict[str, str] = {}
    exit_codes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="sparcml-tta-") as tmp:
        for method in methods:
            part = Path(tmp) / f"{method}.json"
            argv = [
                sys.executable, "-m", "sparcml.tools.cli", "train", recipe, "--env",
                "--methods", method, "--run-json", str(part), *child_args,
            ]  # fmt: skip
            if stop_after and target is not None:
                argv += ["--stop-after", str(stop_after), "--target", repr(target)]
            logs = Path(log_dir) / method if log_dir else None
            log.info("%s %s: starting on %d hosts at %s", recipe, method, hosts, rate)
            code = run_job(hosts // ranks_per_node, argv, rate=rate, timeout=timeout,
                           log_dir=logs, ranks_per_node=ranks_per_node)  # fmt: skip
            if code not in (0, 124) and part.exists():
                # rank 0 wrote the run after the last collective: a rank died at exit
                # (PyTorch's PowerSGD hook on gloo sometimes aborts in teardown,
                # "terminate called without an active exception"); keep the run, say so
                log.warning("%s %s: the job exited with code %d after its run was written; "
                            "kept", recipe, method, code)  # fmt: skip
                exit_codes[method] = code
            elif code != 0 or not part.exists():
                # one failed or stuck method does not cost the others' runs
                why = f"exit code {code}" + (" (timed out)" if code == 124 else "")
                log.error("%s %s: the job failed, %s%s", recipe, method, why,
                          f"; logs in {logs}" if logs else "")  # fmt: skip
                failed[method] = why
                continue
            doc = json.loads(part.read_text())
            if method == baseline:  # the baseline, run first: the target
                final = float(doc["runs"][method]["evals"][-1][recipe_cls.metric])
                target = within_target(final, recipe_cls.higher_is_better)
                log.info("%s: target %s (dense fp32's final %s)", recipe, target, final)
            if merged is None:
                merged = doc
            else:
                merged["runs"].update(doc["runs"])
    if env_data is None:
        os.environ.pop("SPARCML_DATA", None)
    else:
        os.environ["SPARCML_DATA"] = env_data
    if merged is None:
        raise RuntimeError("every job failed: " + "; ".join(f"{m}: {w}" for m, w in failed.items()))
    merged["runs"] = {m: merged["runs"][m] for m in listed if m in merged["runs"]}
    merged["run_order"] = [m for m in methods if m in merged["runs"]]
    merged["link_rate"] = rate
    if stop_after:
        merged["options"] = {**merged.get("options", {}), "stop_after": stop_after,
                             "target": target}  # fmt: skip
    if failed:
        merged["failed"] = failed
    if exit_codes:
        merged["exit_codes"] = exit_codes  # runs kept whose job exited non-zero after them
    return merged


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _spread(xs: Sequence[float | None], spec: str, unit: str = "", none: str = "never") -> str:
    """``median (min-max)`` of the values there are; how many are missing (``none``:
    the target never reached) beside them."""
    got = [x for x in xs if x is not None]
    never = len(xs) - len(got)
    if not got:
        return none
    text = f"{_median(got):{spec}}{unit}"
    if len(got) > 1:
        text += f" ({min(got):{spec}}{unit}-{max(got):{spec}}{unit})"
    return text + (f", {none} in {never}" if never else "")


def seeds_rows(results: Sequence[dict[str, Any]], rate_bps: float | None) -> list[dict[str, Any]]:
    """Per method, the figures of every seed's comparison (lists, in seed order)."""
    keys = (
        "to_within_s", "steps_to_within", "speedup_vs_dense", "speedup_vs_best_hook",
        "ms_per_step", "sync_ms", "wire_ms", "overhead_ms",
    )  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for result in results:
        for r in tta_rows(result, rate_bps):
            row = rows.setdefault(r["method"], {"method": r["method"], **{k: [] for k in keys}})
            for k in keys:
                row[k].append(r.get(k))
            row.setdefault("final", []).append(r[result["metric"]])
            row.setdefault("seeds", []).append(result.get("seed"))
    return list(rows.values())


def format_seeds_table(results: Sequence[dict[str, Any]], rate_bps: float | None) -> str:
    """Medians and ranges over the seeds' comparisons (each seed against its own
    dense baseline and hooks)."""
    metric = results[0]["metric"]
    within = "1 point" if results[0]["higher_is_better"] else "3%"
    seeds = ", ".join(str(r.get("seed")) for r in results)
    lines = [
        f"Median (range) over seeds {seeds}; each seed's runs are compared with that "
        f"seed's dense fp32 run (target: its final test {metric}, within {within}).",
        "",
        f"| method | final {metric} | s to within | steps to within | vs dense fp32 "
        "| vs best PyTorch hook | ms per step | sync ms | wire ms | sync beyond the link ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def fmt_final(values: list[float]) -> str:
        if metric == "accuracy":
            return _spread([100 * v for v in values], ".2f", "%")
        return _spread(values, ".1f")

    every = [r.get("seed") for r in results]
    for r in seeds_rows(results, rate_bps):
        method = r["method"]
        missing = [s for s in every if s not in r["seeds"]]
        if missing:  # its job failed in those seeds: the figures are over the others
            method += f" (not in seed {', '.join(map(str, missing))}: its run failed)"
        lines.append(
            f"| {method} | {fmt_final(r['final'])} | {_spread(r['to_within_s'], '.1f')} "
            f"| {_spread(r['steps_to_within'], '.0f')} "
            f"| {_spread(r['speedup_vs_dense'], '.2f', 'x', '-')} "
            f"| {_spread(r['speedup_vs_best_hook'], '.2f', 'x', '-')} "
            f"| {_spread(r['ms_per_step'], '.1f', '', '-')} "
            f"| {_spread(r['sync_ms'], '.1f', '', '-')} | {_spread(r['wire_ms'], '.1f', '', '-')} "
            f"| {_spread(r['overhead_ms'], '.1f', '', '-')} |"
        )
    return "\n".join(lines)


def write_seeds_report(
    results: Sequence[dict[str, Any]], out: Path, command: str, rate_bps: float | None
) -> list[Path]:
    """``seeds.json`` (every seed's rows) and ``results.md`` (:func:`format_seeds_table`,
    links to each seed's report, the load averages) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    rate = first.get("link_rate") or "loopback"
    doc = {
        "command": command,
        "recipe": first["recipe"],
        "world": first["world"],
        "link_rate": rate,
        "link": first.get("link"),
        "seeds": [r.get("seed") for r in results],
        "rows": seeds_rows(results, rate_bps),
    }
    (out / "seeds.json").write_text(json.dumps(doc, indent=1, default=str))
    md = [
        f"# {first['recipe']}: P = {first['world']}, {rate} links, {len(results)} seeds",
        "",
        *_links_line(first),
        f"Command: `{command}`",
        "",
        format_seeds_table(results, rate_bps),
        "",
        "Each seed's report: "
        + ", ".join(f"[seed {r.get('seed')}](seed{r.get('seed')}/results.md)" for r in results),
        "",
    ]
    orders = [(r.get("seed"), r["run_order"]) for r in results if r.get("run_order")]
    if orders:
        md += [
            "The order the methods ran in, per seed (rotated by one place a seed, the "
            "baseline first where it sets the target): "
            + "; ".join(f"seed {seed}: {', '.join(order)}" for seed, order in orders),
            "",
        ]
    loads = [
        max(run["loadavg"][0] for run in r["runs"].values() if run.get("loadavg"))
        for r in results
        if any(run.get("loadavg") for run in r["runs"].values())
    ]
    if loads:
        md += [
            "Highest 1-minute load average at the end of a run, per seed: "
            + ", ".join(f"{x:.2f}" for x in loads)
            + " (2 cores).",
            "",
        ]
    worst: dict[str, float | None] = {}
    for i, r in enumerate(results):
        steals = [v for run in r["runs"].values() if (v := run.get("cpu_steal")) is not None]
        worst[f"seed {r.get('seed', i)}"] = max(steals) if steals else None
    md += _steal_lines(worst, "Highest CPU steal of a run, per seed")
    (out / "results.md").write_text("\n".join(md))
    return [out / "seeds.json", out / "results.md"]
