r"""An exchange's order over gloo, three ways in one job: ``sparse_allreduce`` calls
alternating round by round between

* ``held`` (the library): an exchange posts its receive first, and a body goes once
  the receive of the peer's body is posted (``isend(after=)``);
* ``unheld``: the receive first, every body sent at once;
* ``send first`` (the library before, and NCCL's order today:
  ``receives_first = False``): the send, then the receive, bodies sent at once.

gloo sends a body only after the receiver's "ready to receive" note and writes it into
the pair's one TCP connection ahead of a note posted later: a body sent at once can
hold back the other direction's. Run inside ``sparcml cluster``::

    sparcml cluster -P 2 --rate 1gbit -- python benchmarks/exchange_hold.py \
        -N 16M -d 0.05 --algorithm ssar_split_allgather --rounds 31

Rank 0 prints each way's p50 and quartiles of the slowest rank's time (the first
round left out). Every exchange of the calls follows the way: ``sendrecv``, the
all-to-all and the rings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import TorchDistCommunicator
from sparcml.tools.cli.common import size_arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", type=size_arg, default=16 << 20)
    ap.add_argument("-d", type=float, default=0.00781)
    ap.add_argument("--algorithm", default="ssar_recursive_double")
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    comm = TorchDistCommunicator()
    me = comm.rank
    k = int(args.N * args.d)
    g = torch.Generator().manual_seed(me)
    idx = torch.randperm(args.N, generator=g)[:k].sort().values
    stream = SparseStream(idx, torch.randn(k, generator=g), args.N)

    held_after = comm._isend_after

    def unheld_after(buf: torch.Tensor, dst: int, tag: int, recv: Any) -> Any:
        return comm._isend(buf, dst, tag)

    # (receives first?, the exchange's send)
    ways: dict[str, tuple[bool, Callable[..., Any]]] = {
        "held": (True, held_after),
        "unheld": (True, unheld_after),
        "send first": (False, unheld_after),
    }
    names = list(ways)
    times: dict[str, list[float]] = {w: [] for w in names}
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            comm.receives_first, comm._isend_after = ways[name]  # type: ignore[method-assign]
            comm.barrier()
            t = time.perf_counter()
            sparse_allreduce(stream, comm, algorithm=args.algorithm)
            times[name].append(time.perf_counter() - t)
    slowest = {w: torch.tensor(v, dtype=torch.float64) for w, v in times.items()}
    for t in slowest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if me == 0:
        print(f"P = {comm.world_size}, N = {args.N:,}, d = {args.d}, {args.algorithm}, "
              f"{args.rounds} rounds, the slowest rank's ms", flush=True)  # fmt: skip
        for w, t in slowest.items():
            ms = sorted(x * 1e3 for x in t.tolist()[1:])
            q = len(ms) // 4
            print(f"  {w:<11} p50 {statistics.median(ms):8.2f}  p25 {ms[q]:8.2f}  "
                  f"p75 {ms[-q - 1]:8.2f}", flush=True)  # fmt: skip
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
