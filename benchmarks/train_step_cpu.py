"""Where a training step's CPU goes, per thread, for each method (issue 13).

The Fashion-MNIST recipe's CNN under DDP on ``P`` local gloo processes (one
torch thread each), the method registered as the DDP communication hook, as
``sparcml train fmnist`` runs it. After a few warm-up steps, ``--steps`` steps
are timed; per method it prints the slowest rank's wall milliseconds per step
(and the ratio to dense), each rank's process CPU per step, and the CPU per step
by thread (mean over ranks, from ``/proc/self/task``): ``MainThread`` (forward,
backward, the hook's launch, the optimizer), ``sparcml-engine`` (the collective
and the compression run there), gloo's own threads (the transport). With more
ranks than cores the step is CPU-bound, so wall time follows CPU per rank.

    .venv/bin/python benchmarks/train_step_cpu.py --methods dense,topk,topk+natural,natural
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


def _rank(comm: Any, method: str, density: float, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparcml import torch as st
    from sparcml.tools.recipes import RECIPES
    from sparcml.tools.recipes.train import method_hyper

    recipe = RECIPES["fmnist"](comm.rank, comm.world_size, 0, limit=8000)
    hyper = method_hyper(method, {"density": density})
    model = DDP(recipe.model())
    st.register(model, method, **hyper)  # dense too: sparcml's dense method, as the recipe
    opt = recipe.optimizer(model.parameters(), momentum=not hyper.get("momentum"))
    batches = list(recipe.batches(0))

    def step(i: int) -> None:
        loss = recipe.loss(model, *batches[i % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(warmup):
        step(i)
    before, cpu0, ru0 = _threads(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    wall = (time.perf_counter() - t0) / steps * 1e3
    cpu = (time.process_time() - cpu0) / steps * 1e3
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    per: dict[str, float] = {}
    for tid, (name, ms) in _threads().items():
        per[name] = per.get(name, 0.0) + (ms - before.get(tid, (name, 0.0))[1]) / steps
    return {
        "wall": wall,
        "cpu": cpu,
        "threads": per,
        "voluntary": (ru1.ru_nvcsw - ru0.ru_nvcsw) / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dense,topk,topk+natural,natural")
    ap.add_argument("-P", "--world-size", type=int, default=4)
    ap.add_argument("-d", "--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    p = args.world_size
    print(f"FMNIST CNN, DDP, {p} gloo processes, {args.steps} steps after {args.warmup}")
    dense_wall = None
    for method in args.methods.split(","):
        res = run_processes(p, _rank, method, args.density, args.steps, args.warmup, timeout=300)
        wall = max(r["wall"] for r in res)
        if method == "dense":
            dense_wall = wall
        ratio = f" ({wall / dense_wall:.2f}x dense)" if dense_wall else ""
        names = sorted({n for r in res for n in r["threads"]})
        mean = {n: sum(r["threads"].get(n, 0.0) for r in res) / p for n in names}
        threads = ", ".join(f"{n} {v:.1f}" for n, v in mean.items() if v >= 0.05)
        cpus = " ".join(f"{r['cpu']:.1f}" for r in res)
        print(
            f"{method:14s} wall {wall:6.1f} ms/step{ratio}; process CPU per rank {cpus} ms; "
            f"by thread (mean): {threads}; voluntary switches/step {res[0]['voluntary']:.0f}"
        )


if __name__ == "__main__":
    main()
