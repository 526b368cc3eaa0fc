r"""The CPU of a training step's reduction, this checkout against another, in one process.

Issue 30's lean step: what a method's reduction of one sparse gradient costs in
CPU, with the library of ``--before`` (another checkout's ``src`` folder) next to
this one, alternated round by round in one process so both see the same machine
(separate jobs on a shared 2-core host drift by more than the difference). Each
round runs ``P`` in-process ranks (threads: :func:`sparcml.comm.run_ranks`; a rank
waiting for a message blocks without spinning, so the process's CPU time is the
ranks' work) through ``--warmup`` then ``--steps`` calls of
:func:`sparcml.torch.sync_gradients` on an ``EmbeddingBag(features, 1,
sparse=True)``-like gradient of ``--nonzeros`` uniform random rows per rank, and
prints the process CPU per step of all ranks together (engine threads included),
per library: the median over rounds, and the median and range of the per-round
ratio.

    git worktree add /tmp/before 42a2376
    .venv/bin/python benchmarks/step_cpu_ab.py --before /tmp/before/src \
        --methods nonzeros,topk,topk+natural --nonzeros 4400

``--nonzeros 0`` gives each rank a dense gradient of ``--features`` normal entries
instead (a dense layer: ``wordlm``'s 1,323,280 entries with ``--features 1323280``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from types import ModuleType
from typing import Any

import torch
from codec_ab import load_before, ratio_text  # this folder, on sys.path when run as a script

import sparcml
from sparcml.tools.cli.common import size_arg


def _round(lib: ModuleType, method: str, args: argparse.Namespace) -> float:
    """Process CPU seconds per step of one round's timed steps (all ranks)."""
    st = importlib.import_module(lib.__name__ + ".torch")
    train = importlib.import_module(lib.__name__ + ".tools.recipes.train")
    comm_mod = importlib.import_module(lib.__name__ + ".comm")
    n = args.features

    def rank(comm: Any) -> float:
        # (a sparse gradient is an EmbeddingBag(n, 1, sparse=True)'s: rows of one entry)
        p = torch.nn.Parameter(torch.zeros(n, 1) if args.nonzeros else torch.zeros(n))
        hyper = train.method_hyper(
            method, {"density": args.density, "index_coding": "delta"}, momentum=0
        )
        state = st.SparcmlState(method, comm=comm, **hyper)
        gen = torch.Generator().manual_seed(comm.rank)
        grads = []
        for _ in range(8):
            if not args.nonzeros:  # a dense gradient (a layer of normal entries)
                grads.append(torch.randn(n, generator=gen))
                continue
            rows = torch.randint(0, n, (args.nonzeros,), generator=gen)
            values = torch.randn(args.nonzeros, 1, generator=gen)
            grads.append(torch.sparse_coo_tensor(rows[None], values, (n, 1)).coalesce())
        for i in range(args.warmup):
            p.grad = grads[i % 8].clone()
            st.sync_gradients([p], state)
        t0 = time.process_time()
        for i in range(args.steps):
            p.grad = grads[i % 8].clone()
            st.sync_gradients([p], state)
        return (time.process_time() - t0) / args.steps

    return comm_mod.run_ranks(args.world_size, rank, timeout=120.0)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="another checkout's src folder")
    ap.add_argument("--methods", default="nonzeros,topk,topk+natural")
    ap.add_argument("--features", type=size_arg, default=size_arg("1M"))
    ap.add_argument(
        "--nonzeros",
        type=int,
        default=4400,
        help="rows of each rank's sparse gradient; 0: a dense gradient of --features entries",
    )
    ap.add_argument("-d", "--density", type=float, default=0.01)
    ap.add_argument("-P", "--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = load_before(args.before)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    what = (f"{args.nonzeros:,} a rank a step" if args.nonzeros
            else "a dense gradient of normal entries")  # fmt: skip
    print(f"P={args.world_size} in-process ranks, {args.features:,} rows, "
          f"{what}, {args.rounds} rounds of {args.steps} steps "
          f"after {args.warmup}, libraries alternated; load average {load}")  # fmt: skip
    print(f"{'method':<14} {'before ms':>10} {'after ms':>9}  before/after per round")
    for method in args.methods.split(","):
        a: list[float] = []
        b: list[float] = []
        for _ in range(args.rounds):
            a.append(_round(before, method, args) * 1e3)
            b.append(_round(sparcml, method, args) * 1e3)
        print(f"{method:<14} {statistics.median(a):>10.3f} {statistics.median(b):>9.3f}  "
              f"{ratio_text(a, b)}")  # fmt: skip
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
