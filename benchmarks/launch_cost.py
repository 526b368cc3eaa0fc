r"""What starting local ranks costs: ``run_processes`` from its fork server against spawn.

Each launch starts ``P`` ranks over gloo on loopback and runs one of two jobs:
``nop`` (return the rank) or ``train`` (a small MLP, ``SparcmlState("topk")`` and
``DistributedOptimizer`` around SGD, 5 steps: what the spawned tests do). Every
launch is timed from the call to its results, ``--repeats`` times per start method
and job, the two start methods alternating; the fork server's first launch (it
starts the server and imports ``PRELOAD`` there) is printed on its own. The last
column is the median launch.

    .venv/bin/python benchmarks/launch_cost.py -P 2 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from sparcml.comm.launch import PRELOAD, run_processes


def nop(comm: Any) -> int:
    return int(comm.rank)


def train(comm: Any) -> float:
    from sparcml import torch as st

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = st.SparcmlState("topk", density=0.1, comm=comm)
    st.broadcast_parameters(model, state)
    opt = st.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, state)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


JOBS = {"nop": nop, "train": train}


def _launch(p: int, job: str, method: str) -> float:
    t0 = time.perf_counter()
    run_processes(p, JOBS[job], timeout=60, start_method=method)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", "--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores; "
        f"torch {torch.__version__}; fork server preload: {', '.join(PRELOAD)}"
    )
    first = _launch(args.world_sizes[0], "nop", "forkserver")
    print(f"fork server's first launch (P = {args.world_sizes[0]}, nop): {first:.2f} s")
    print(f"{'P':>3} {'job':6} {'start method':12} {'launches, s':40} {'median s':>9}")
    for p in args.world_sizes:
        for job in JOBS:
            times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
            for _ in range(args.repeats):
                for method in times:  # alternating, so the machine's drift hits both
                    times[method].append(_launch(p, job, method))
            for method, ts in times.items():
                shown = " ".join(f"{t:.2f}" for t in ts)
                print(f"{p:>3} {job:6} {method:12} {shown:40} {statistics.median(ts):9.2f}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
