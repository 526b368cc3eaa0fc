"""Where the engine thread's time goes for one method, per step (issue 30, item 2).

``P`` local gloo processes each reduce one parameter's gradient with
:func:`sparcml.torch.sync_gradients` every step, as a training step's hook would;
the gradient has ``--nonzeros`` uniform random non-zeros (a sparse-feature layer:
hashed bag-of-words, embedding inputs), or is dense with ``--nonzeros 0``; with
``--sparse-gradient`` it is a sparse COO tensor of those rows, as
``EmbeddingBag(features, 1, sparse=True)`` gives. After
a few warm-up steps, every call the engine thread runs is profiled (cProfile),
and rank 0's functions are printed by their own time per step. The wall and
process CPU per step are printed for each rank, unprofiled, from a first pass
(``--no-profile``: that pass alone). ``--torch-ops`` profiles torch's operators on
the engine thread instead (``torch.profiler``, by their own CPU time): where a
step's many small tensor operations go.

    .venv/bin/python benchmarks/engine_profile.py --features 1M --nonzeros 6000
    .venv/bin/python benchmarks/engine_profile.py --features 1M --nonzeros 6000 --sparse-gradient
    .venv/bin/python benchmarks/engine_profile.py --method topk+natural --features 1M \
        --nonzeros 4400 --sparse-gradient --torch-ops

Times depend on the machine: run it on a quiet one (the load average is printed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from typing import Any

import torch

from sparcml.comm.launch import run_processes
from sparcml.tools.cli.common import size_arg


def _rank(comm: Any, args: argparse.Namespace, profile: bool) -> tuple[float, float, str]:
    torch.set_num_threads(1)
    import sparcml.torch as st
    from sparcml.comm.engine import Engine
    from sparcml.tools.recipes.train import method_hyper

    n = args.features
    # a sparse gradient is an EmbeddingBag(n, 1, sparse=True)'s: rows of one entry
    p = torch.nn.Parameter(torch.zeros(n, 1) if args.sparse_gradient else torch.zeros(n))
    # what sparcml train gives the method (plain SGD, as the newsgroups recipe)
    hyper = method_hyper(
        args.method, {"density": args.density, "index_coding": "delta"}, momentum=0
    )
    state = st.SparcmlState(args.method, comm=comm, **hyper)
    gen = torch.Generator().manual_seed(comm.rank)
    grads = []
    for _ in range(16):
        if args.nonzeros and args.sparse_gradient:
            rows = torch.randint(0, n, (args.nonzeros,), generator=gen)
            x = torch.sparse_coo_tensor(
                rows[None], torch.randn(args.nonzeros, 1, generator=gen), (n, 1)
            ).coalesce()
        elif args.nonzeros:
            x = torch.zeros(n)
            x[torch.randint(0, n, (args.nonzeros,), generator=gen)] = torch.randn(
                args.nonzeros, generator=gen
            )
        else:
            x = torch.randn(n, generator=gen)
        grads.append(x)

    def step(i: int) -> None:
        p.grad = grads[i % len(grads)].clone()
        st.sync_gradients([p], state)

    for i in range(args.warmup):
        step(i)
    prof = cProfile.Profile()
    if profile and args.torch_ops:  # torch's operators on the engine thread, self CPU
        ops = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        engines: list[Engine] = []
        submit = Engine.submit

        def first(self: Engine, fn: Any) -> Any:
            if not engines:  # (the profiler records the thread that starts it)
                engines.append(self)
                submit(self, ops.start).wait()
            return submit(self, fn)

        Engine.submit = first  # type: ignore[method-assign]
        for i in range(args.steps):
            step(args.warmup + i)
        submit(engines[0], ops.stop).wait()
        Engine.submit = submit  # type: ignore[method-assign]
        table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
        return 0.0, 0.0, table
    if profile:  # every call the engine runs, on the engine's own thread
        submit = Engine.submit
        Engine.submit = lambda self, fn: submit(self, lambda: prof.runcall(fn))  # type: ignore[method-assign]
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        step(args.warmup + i)
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    cpu = (time.process_time() - c0) / args.steps * 1e3
    text = ""
    if profile:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        text = out.getvalue()
    return wall, cpu, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="topk")
    ap.add_argument("--features", type=size_arg, default=size_arg("1M"))
    ap.add_argument("--nonzeros", type=int, default=6000, help="0: a dense gradient")
    ap.add_argument(
        "--sparse-gradient",
        action="store_true",
        help="the gradient as a sparse COO tensor of (features, 1), as EmbeddingBag(sparse=True)",
    )
    ap.add_argument("-d", "--density", type=float, default=0.01)
    ap.add_argument("-P", "--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--top", type=int, default=25, help="functions printed")
    ap.add_argument(
        "--no-profile", action="store_true", help="the unprofiled pass only (time per step)"
    )
    ap.add_argument(
        "--torch-ops",
        action="store_true",
        help="profile torch's operators (self CPU, every thread) instead of Python functions",
    )
    args = ap.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    what = f"{args.nonzeros} non-zeros" if args.nonzeros else "dense"
    if args.sparse_gradient:
        if not args.nonzeros:
            ap.error("--sparse-gradient needs --nonzeros above 0")
        what += ", a sparse COO gradient"
    print(
        f"{args.method}, density {args.density:g}, one parameter of {args.features} entries "
        f"({what}), {args.world_size} gloo processes, {args.steps} steps after "
        f"{args.warmup}; load average {load}"
    )
    for profile in (False,) if args.no_profile else (False, True):
        res = run_processes(args.world_size, _rank, args, profile, timeout=600)
        label = "profiled" if profile else "unprofiled"
        for r, (wall, cpu, _) in enumerate(res):
            print(f"rank {r} ({label}): {wall:.2f} ms a step, process CPU {cpu:.2f} ms a step")
    if not args.no_profile:
        what = "torch operators on the engine thread" if args.torch_ops else "engine thread"
        print(f"rank 0's {what}, {args.steps} steps (divide by them for a step):")
        print(res[0][2])


if __name__ == "__main__":
    main()
