r"""The first calls of a process, call by call: what ``auto`` measures on.

Issue 31: at 2 x 4 ranks and d = 5%, ``auto`` measured ``twolevel_leader`` faster
than ``twolevel_shard`` on its first calls, while ``sparcml bench``'s timed rows,
later in the same process, put the shard arrangement ahead. Run as the ranks of a
torch.distributed job (``sparcml cluster ... --``) in a fresh process, this calls
the given algorithms in turn (``--rounds`` rounds, after a barrier each) on one
stream of uniform random indices per rank and prints the slowest rank's time of
every call, in order: the first call of the process (compiling and caching the
CPU kernels), then how the times settle over the next ones. With ``-a auto``
rank 0 also logs ``auto``'s decisions (what it measures, what it settles on, a
recheck that measures again) and lists its classes at the end.

    sparcml cluster --nodes 2 --ranks-per-node 4 --rate 1gbit -- \
        .venv/bin/python benchmarks/first_calls.py -N 16M -d 0.05 --rounds 8

glibc returns freed blocks above its mmap threshold (128 KiB at first, raised to
the size of each freed mmap'd block, up to 32 MiB) to the kernel, so a fresh
process pays page faults on buffers a settled one reuses; to see that, run the
same with ``env MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=1073741824``
before the interpreter (glibc's own tunables; sparcml sets none).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist

from sparcml import sparse_allreduce
from sparcml.collectives.autotune import auto_choices
from sparcml.comm import TorchDistCommunicator
from sparcml.tools.bench import gradient_like
from sparcml.tools.cli.common import size_arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.05)
    ap.add_argument("-a", "--algorithms", default="twolevel_shard,twolevel_leader")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    comm = TorchDistCommunicator()
    stream = gradient_like(args.size, args.density, comm.rank, overlap=0, seed=0)
    names = args.algorithms.split(",")
    if "auto" in names and comm.rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    times: dict[str, list[float]] = {a: [] for a in names}
    for _ in range(args.rounds):
        for a in names:
            dist.barrier()
            t0 = comm.now()
            sparse_allreduce(stream, comm, algorithm=a)
            worst = torch.tensor([comm.now() - t0], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[a].append(float(worst) * 1e3)
    if comm.rank == 0:
        malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's default")
        print(
            f"P={comm.world_size} N={args.size:,} d={args.density} nodes of "
            f"{comm.topology.ranks_per_node} rank(s); MALLOC_MMAP_THRESHOLD_={malloc}; "
            "slowest rank's ms per call, in call order (round robin):",
            flush=True,
        )
        for a, v in times.items():
            for i in range(0, len(v), 10):  # ten calls a line
                label = a if i == 0 else f"  calls {i + 1}-"
                print(f"{label:28s}" + "".join(f"{t:9.1f}" for t in v[i : i + 10]), flush=True)
        for c in auto_choices(comm):
            print(
                f"auto, {c.cls}: ran {c.winner}; runner-up {c.runner_up}; "
                f"measured again {c.rechecks} time(s)",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
