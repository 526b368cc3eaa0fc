"""Does DistributedOptimizer overlap communication with backward? Measured side by side.

A model of several large layers; per step, in the same processes and interleaved:

* ``compute``: forward + backward, no synchronisation (and no update);
* ``sequential``: the same, then :func:`sparcml.torch.sync_gradients` (every bucket
  reduced after backward: ``DistributedOptimizer(overlap=False)``);
* ``overlapped``: ``DistributedOptimizer(overlap=True)``: each bucket's reduction
  starts during backward as soon as its gradients are accumulated.

The gain is ``sequential - overlapped``; at most ``min(backward, communication)``
can be hidden. Local ranks (gloo on loopback)::

    .venv/bin/python examples/overlap_benchmark.py -P 2

or one rank per emulated host over shaped links (root)::

    .venv/bin/sparcml cluster -P 2 --rate 1gbit -- .venv/bin/python \\
        examples/overlap_benchmark.py --env
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import sparcml.torch as st


def _model(width: int, layers: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / width**0.5)
    return model


def run(comm: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    model = _model(args.width, args.layers)
    bucket = args.width * args.width * 4  # one layer per bucket
    seq_state = st.SparcmlState(args.method, args.density, comm=comm, bucket_bytes=bucket)
    ovl_state = st.SparcmlState(args.method, args.density, comm=comm, bucket_bytes=bucket)
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    overlapped = st.DistributedOptimizer(base, model, ovl_state, overlap=True)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(comm.rank))

    def step(kind: str) -> float:
        overlapped.overlap = kind == "overlapped"  # (its hooks do nothing otherwise)
        comm.barrier()
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        if kind == "overlapped":
            overlapped.step()
        elif kind == "sequential":
            st.sync_gradients(model, seq_state)
            base.step()  # (compute: no update, so the ranks' parameters stay equal)
        base.zero_grad()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"compute": [], "sequential": [], "overlapped": []}
    for i in range(args.steps + 1):
        for kind in times:
            dt = step(kind)
            if i:  # the first round warms up
                times[kind].append(dt)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-P", "--world-size", type=int, default=2)
    ap.add_argument("--env", action="store_true", help="join a torchrun / sparcml cluster job")
    ap.add_argument("--method", default="natural")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.env:
        import torch.distributed as dist

        from sparcml.comm import TorchDistCommunicator

        dist.init_process_group("gloo")
        comm = TorchDistCommunicator()
        times = run(comm, args)
        rank, world = comm.rank, comm.world_size
        dist.destroy_process_group()  # PyTorch's documented shutdown
    else:
        from sparcml.comm.launch import run_processes

        times = run_processes(args.world_size, run, args, timeout=600)[0]
        rank, world = 0, args.world_size
    if rank != 0:
        return
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    comm_ms = med["sequential"] - med["compute"]
    hidden = med["sequential"] - med["overlapped"]
    print(
        f"P={world} method={args.method} {args.layers} layers of {args.width}x{args.width} "
        f"({args.layers * args.width * args.width * 4 / 1e6:.0f} MB of gradients), "
        f"batch {args.batch}, median of {args.steps} steps"
    )
    for k, v in med.items():
        print(f"  {k:<11} {v:8.1f} ms/step")
    print(
        f"  communication after backward: {comm_ms:.1f} ms; hidden by overlap: {hidden:.1f} ms "
        f"({100 * hidden / comm_ms if comm_ms > 0 else 0:.0f}% of it)"
    )


if __name__ == "__main__":
    main()
