"""Where a training step's CPU goes, per thread, for each method (issue 13).

A recipe's model (``--recipe``, default the Fashion-MNIST CNN) under DDP on ``P``
local gloo processes (one torch thread each), the method registered as the DDP
communication hook with the hyperparameters ``sparcml train`` gives it. After a
few warm-up steps, ``--steps`` steps are timed; per method it prints the slowest
rank's wall milliseconds per step (and the ratio to dense), the hook's own clock
per step (``local``: accumulation, selection, encoding and residual update;
``collective``: the exchange), each rank's process CPU per step, and the CPU per
step by thread (mean over ranks, from ``/proc/self/task``): ``MainThread``
(forward, backward, the hook's launch, the optimizer), ``sparcml-engine`` (the
collective and the compression run there), gloo's own threads (the transport).
With more ranks than cores the step is CPU-bound, so wall time follows CPU per
rank.

    .venv/bin/python benchmarks/train_step_cpu.py --methods dense,topk,topk+natural,natural
    .venv/bin/python benchmarks/train_step_cpu.py --recipe wordlm -P 2 --methods topk,oktopk
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time
from typing import Any

import torch

from sparcml.comm.launch import run_processes

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _threads() -> dict[str, tuple[str, float]]:
    """CPU milliseconds so far of each thread of this process: tid -> (name, ms)."""
    names = {str(t.native_id): t.name.split("-rank")[0] for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[tid] = (names.get(tid, comm), (int(fields[11]) + int(fields[12])) * _TICK_MS)
    return out


def _rank(
    comm: Any,
    recipe_name: str,
    method: str,
    density: float,
    steps: int,
    warmup: int,
    options: dict[str, str],
) -> dict[str, Any]:
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparcml import torch as st
    from sparcml.tools.recipes import RECIPES
    from sparcml.tools.recipes.train import method_hyper

    cls = RECIPES[recipe_name]
    recipe = cls(comm.rank, comm.world_size, 0, limit=8000, **options)
    hyper = method_hyper(method, {"density": density}, momentum=cls.momentum)
    model = DDP(recipe.model())
    state = st.register(model, method, **hyper)  # dense too: sparcml's method, as the recipe
    opt = recipe.optimizer(model.parameters(), momentum=not hyper.get("momentum"))
    batches = list(recipe.batches(0))

    def step(i: int) -> None:
        loss = recipe.loss(model, *batches[i % len(batches)])
        opt.zero_grad()
        loss.backward()
        recipe.clip(model)
        opt.step()

    def hook_clock() -> tuple[float, float]:
        groups = [state, *getattr(state, "children", ())]
        return (
            sum(g.stats.compress_s for g in groups if hasattr(g, "stats")),
            sum(g.stats.communicate_s for g in groups if hasattr(g, "stats")),
        )

    for i in range(warmup):
        step(i)
    before, cpu0, ru0 = _threads(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    clock0 = hook_clock()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    wall = (time.perf_counter() - t0) / steps * 1e3
    clock1 = hook_clock()
    cpu = (time.process_time() - cpu0) / steps * 1e3
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    per: dict[str, float] = {}
    for tid, (name, ms) in _threads().items():
        per[name] = per.get(name, 0.0) + (ms - before.get(tid, (name, 0.0))[1]) / steps
    return {
        "wall": wall,
        "local": (clock1[0] - clock0[0]) / steps * 1e3,
        "collective": (clock1[1] - clock0[1]) / steps * 1e3,
        "cpu": cpu,
        "threads": per,
        "voluntary": (ru1.ru_nvcsw - ru0.ru_nvcsw) / steps,
        "faults": (ru1.ru_minflt - ru0.ru_minflt) / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="fmnist", help="fmnist, shakespeare, wordlm, newsgroups")
    ap.add_argument("--methods", default="dense,topk,topk+natural,natural")
    ap.add_argument("-P", "--world-size", type=int, default=4)
    ap.add_argument("-d", "--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--recipe-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe option, as for sparcml train (e.g. features=1048576)",
    )
    args = ap.parse_args()
    options = {}
    for item in args.recipe_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--recipe-option takes KEY=VALUE, got {item!r}")
        options[key] = value
    p = args.world_size
    print(
        f"{args.recipe}{''.join(f' {k}={v}' for k, v in options.items())}, "
        f"DDP, {p} gloo processes, {args.steps} steps after {args.warmup}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    dense_wall = None
    for method in args.methods.split(","):
        res = run_processes(
            p,
            _rank,
            args.recipe,
            method,
            args.density,
            args.steps,
            args.warmup,
            options,
            timeout=600,
        )
        wall = max(r["wall"] for r in res)
        if method == "dense":
            dense_wall = wall
        ratio = f" ({wall / dense_wall:.2f}x dense)" if dense_wall else ""
        names = sorted({n for r in res for n in r["threads"]})
        mean = {n: sum(r["threads"].get(n, 0.0) for r in res) / p for n in names}
        threads = ", ".join(f"{n} {v:.1f}" for n, v in mean.items() if v >= 0.05)
        cpus = " ".join(f"{r['cpu']:.1f}" for r in res)
        local = sum(r["local"] for r in res) / p
        coll = sum(r["collective"] for r in res) / p
        print(
            f"{method:14s} wall {wall:6.1f} ms/step{ratio}; hook local {local:.1f} ms, "
            f"collective {coll:.1f} ms; process CPU per rank {cpus} ms; "
            f"by thread (mean): {threads}; voluntary switches/step {res[0]['voluntary']:.0f}; "
            f"page faults/step {res[0]['faults']:.0f}"
        )


if __name__ == "__main__":
    main()
