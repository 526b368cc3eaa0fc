"""The training loop every recipe shares, and the driver behind ``sparcml train``.

Each method runs on ``P`` local gloo processes: the recipe's model wrapped in DDP,
the method registered as its communication hook (``dense`` too, so every
method's bytes are counted the same way), identical initialisation and data
shards for every method (same seed). Per step it records the loss, the bytes
this rank sent and the wall time; per epoch the test figures (rank 0).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from ...comm.launch import run_processes
from ..bench.harness import write_json

__all__ = ["run_recipe", "train_worker", "write_report"]


class _Progress:
    """A one-line progress bar on stderr (rank 0 only), redrawn at most twice a second."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.start = time.monotonic()
        self.last = 0.0

    def update(self, done: int, extra: str = "") -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.5 and done < self.total):
            return
        self.last = now
        frac = done / max(1, self.total)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        eta = (now - self.start) / max(frac, 1e-9) * (1 - frac)
        sys.stderr.write(f"\r{self.label:<28} [{bar}] {done}/{self.total} {extra} eta {eta:5.0f}s ")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def train_worker(
    comm: Any, recipe_name: str, method: str, hyper: dict[str, Any], epochs: int,
    seed: int, options: dict[str, Any], progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """One rank of one method's run (for :func:`sparcml.comm.launch.run_processes`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ... import torch as st
    from . import RECIPES

    recipe = RECIPES[recipe_name](comm.rank, comm.world_size, seed, **options)
    if recipe.steps_per_epoch() < 1:
        raise ValueError(
            f"{recipe_name}: {options.get('limit') or 'all'} training samples give no "
            f"training step at {comm.world_size} ranks x batch {getattr(recipe, 'batch', '?')}; "
            f"use --limit >= {comm.world_size * getattr(recipe, 'batch', 1)} (it counts samples)"
        )
    fsdp = bool(options.get("fsdp"))
    if options.get("density_warmup"):  # DGC's warm-up: 25% falling to the density
        hyper = {
            **hyper,
            "density": st.DensityWarmup(
                recipe.steps_per_epoch(), options["density_warmup"], 0.25, hyper["density"]
            ),
        }
    if fsdp:
        # FSDP2: every module with parameters of its own sharded, then the root; the
        # method is the reduce-scatter (sparcml.torch.register_fsdp)
        from torch.distributed.fsdp import fully_shard

        model = recipe.model()
        for sub in model.modules():
            if sub is not model and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub)
        fully_shard(model)
        state = st.register_fsdp(model, method, **hyper)
        inner = model
    else:
        model = DDP(recipe.model())
        state = st.register(model, method, **hyper)
        inner = model.module
    # DGC momentum correction moves the momentum from the optimizer into the state
    opt = recipe.optimizer(model.parameters(), momentum=not hyper.get("momentum"))
    steps = recipe.steps_per_epoch()
    bar = _Progress(epochs * steps, f"{recipe_name} {method}", progress and comm.rank == 0)
    losses: list[float] = []
    step_times: list[float] = []
    evals: list[dict[str, float]] = []
    for epoch in range(epochs):
        model.train()
        for i, (inputs, target) in enumerate(recipe.batches(epoch)):
            t0 = time.perf_counter()
            loss = recipe.loss(model, inputs, target)
            opt.zero_grad()
            loss.backward()  # the hook synchronises here
            recipe.clip(model)
            opt.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            bar.update(epoch * steps + i + 1, f"loss {losses[-1]:.3f}")
        model.eval()
        # (FSDP's forward is a collective: every rank evaluates, rank 0's figures kept)
        figures = recipe.evaluate(inner) if comm.rank == 0 or fsdp else {}
        if comm.rank != 0:
            figures = {}
        figures["epoch"] = epoch + 1
        evals.append(figures)
    # every rank's mean loss per step, so the curve is the global training loss
    loss_t = comm.allreduce(torch.tensor(losses, dtype=torch.float64)) / comm.world_size
    bytes_t = comm.allreduce(torch.tensor(state.step_bytes, dtype=torch.float64))
    return {
        "losses": loss_t.tolist(),
        "step_bytes": (bytes_t / comm.world_size).tolist(),
        "step_times": step_times,
        "evals": evals,
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_recipe(
    recipe_name: str,
    methods: list[str],
    world: int = 4,
    epochs: int | None = None,
    hyper: dict[str, Any] | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every method in turn on ``world`` local ranks; returns the runs by method."""
    from . import RECIPES

    if recipe_name not in RECIPES:
        raise ValueError(f"unknown recipe {recipe_name!r}; available: {', '.join(RECIPES)}")
    recipe_cls = RECIPES[recipe_name]
    recipe_cls.check_data()  # fail here, with the command to run, not inside every rank
    epochs = epochs or recipe_cls.epochs
    runs: dict[str, Any] = {}
    for method in methods:
        h = dict(hyper or {})
        if method in (
            "dense", "nonzeros", "qsgd", "natural", "natural_dithering", "dithering",
            "natural_ina",
        ):  # fmt: skip
            h.pop("density", None)
            h.pop("momentum", None)  # momentum correction is for sparse methods
            h.pop("index_coding", None)
        elif "momentum" not in h:
            # error feedback and the optimizer's momentum amplify each other: sparse
            # methods get DGC momentum correction (the optimizer then runs without)
            h["momentum"] = 0.9
        server = None
        if method == "natural_ina" and "ina_server" not in h:
            from ...ina import AggregatorServer

            server = AggregatorServer().start()  # an aggregator for this run, on loopback
            h["ina_server"] = f"{server.address[0]}:{server.address[1]}"
        t0 = time.monotonic()
        try:
            out = run_processes(
                world, train_worker, recipe_name, method, h, epochs, seed, options or {},
                progress, timeout=600, deadline=6 * 3600,
            )  # fmt: skip
        finally:
            if server is not None:
                h["aggregator_counters"] = server.snapshot()
                h.pop("ina_server")
                server.stop()
        run = out[0]
        run["wall_s"] = time.monotonic() - t0
        run["hyper"] = h
        runs[method] = run
    return {
        "recipe": recipe_name,
        "world": world,
        "epochs": epochs,
        "seed": seed,
        "metric": recipe_cls.metric,
        "higher_is_better": recipe_cls.higher_is_better,
        "options": options or {},
        "runs": runs,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Final figures per method; bytes and times averaged over the steps after the
    dense warm-up (``warmup_steps``), when there is one."""
    metric = result["metric"]

    def warm(run: dict[str, Any]) -> int:
        return int(run.get("hyper", {}).get("warmup_steps", 0))

    dense = result["runs"].get("dense")
    dense_bytes = _mean(dense["step_bytes"][warm(dense) :]) if dense else None
    rows = []
    for method, run in result["runs"].items():
        final = run["evals"][-1]
        warmup = warm(run)
        b = _mean(run["step_bytes"][warmup:])
        rows.append(
            {
                "method": method,
                metric: final[metric],
                "test_loss": final["test_loss"],
                "bytes_per_step": b,
                "fewer_bytes_than_dense": (dense_bytes / b) if dense_bytes and b else None,
                "ms_per_step": 1000 * _mean(run["step_times"][warmup:]),
                "final_train_loss": _mean(run["losses"][-20:]),
            }
        )
    return rows


def format_table(result: dict[str, Any]) -> str:
    metric = result["metric"]
    head = (
        f"| method | test {metric} | test loss | bytes sent per step (per rank) "
        "| fewer bytes than dense | ms per step |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in summary_rows(result):
        ratio = f"{r['fewer_bytes_than_dense']:.1f}x" if r["fewer_bytes_than_dense"] else "-"
        value = f"{100 * r[metric]:.2f}%" if metric == "accuracy" else f"{r[metric]:.3f}"
        lines.append(
            f"| {r['method']} | {value} | {r['test_loss']:.4f} | {r['bytes_per_step']:,.0f} "
            f"| {ratio} | {r['ms_per_step']:.1f} |"
        )
    return "\n".join(lines)


def write_report(result: dict[str, Any], out: Path, command: str) -> list[Path]:
    """Write ``results.json``, ``results.md`` (table + command) and plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    config = {k: v for k, v in result.items() if k != "runs"}
    write_json(out / "results.json", "train", result["runs"], config, command=command, **config)
    written.append(out / "results.json")
    md = [
        f"# {result['recipe']}: {result['world']} ranks, {result['epochs']} epochs",
        "",
        f"Command: `{command}`",
        "",
        "Hyperparameters per method: "
        + "; ".join(f"{m}: {r.get('hyper', {})}" for m, r in result["runs"].items())
        + " (bytes and ms per step: mean over the steps after any dense warm-up; time per "
        "step on a shared 2-core machine running all ranks, indicative only)",
        "",
        format_table(result),
        "",
    ]
    (out / "results.md").write_text("\n".join(md))
    written.append(out / "results.md")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:  # plots need the bench extra
        return written
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    metric = result["metric"]
    for method, run in result["runs"].items():
        losses = torch.tensor(run["losses"])
        w = max(1, len(losses) // 100)
        smooth = losses.unfold(0, w, w).mean(1) if len(losses) >= w else losses
        axes[0].plot([(i + 0.5) * w for i in range(len(smooth))], smooth.tolist(), label=method)
        axes[1].plot(
            [e["epoch"] for e in run["evals"]],
            [e[metric] for e in run["evals"]],
            marker="o",
            label=method,
        )
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss (mean over ranks)")
    axes[0].set_yscale("log")
    axes[1].set_xlabel("epoch")
    axes[1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[1].set_ylabel(f"test {metric}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['recipe']}, {result['world']} ranks")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    written.append(out / "curves.png")
    return written
