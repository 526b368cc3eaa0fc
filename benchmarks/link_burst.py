r"""What the emulated link's token bucket lets through at once: one exchange
(``isend`` + ``irecv`` of the same size both ways) between two ranks, after the link
idled and back to back, against the bytes' time at the rate.

``tc tbf`` sends a full bucket at once; a real link serialises every byte at its
rate. ``sparcml cluster`` gives every link a 256 KB bucket (``$SPARCML_CLUSTER_BURST``
sets another): 2 ms of a 1 Gbit/s link, 21 ms of a 100 Mbit/s one::

    sparcml cluster -P 2 --rate 100mbit -- python benchmarks/link_burst.py --rate 100mbit
    SPARCML_CLUSTER_BURST=64kb sparcml cluster -P 2 --rate 100mbit -- \
        python benchmarks/link_burst.py --rate 100mbit

Rank 0 prints each size's median over ``--calls`` exchanges (after a barrier each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from sparcml.tools.cli.common import size_arg
from sparcml.tools.cluster import parse_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", required=True, help="the cluster's link rate (tc syntax)")
    ap.add_argument("--sizes", default="92774,377690,2M", help="bytes, comma-separated")
    ap.add_argument("--idle-ms", type=float, default=15.0, help="idle time before a call")
    ap.add_argument("--calls", type=int, default=25)
    args = ap.parse_args()
    rate = parse_rate(args.rate)
    dist.init_process_group("gloo")
    me, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise SystemExit("link_burst.py runs on 2 ranks (sparcml cluster -P 2)")
    if me == 0:
        burst = os.environ.get("SPARCML_CLUSTER_BURST", "256kb (the default)")
        print(f"bucket {burst}; {args.calls} exchanges each, rank 0's p50", flush=True)
    for nbytes in (size_arg(s) for s in args.sizes.split(",")):
        snd = torch.zeros(nbytes, dtype=torch.uint8)
        rcv = torch.empty_like(snd)
        for idle in (args.idle_ms / 1e3, 0.0):
            times = []
            for _ in range(args.calls + 1):
                dist.barrier()
                time.sleep(idle)
                dist.barrier()
                t = time.perf_counter()
                for work in [dist.isend(snd, 1 - me), dist.irecv(rcv, 1 - me)]:
                    work.wait()
                times.append(time.perf_counter() - t)
            if me == 0:
                print(f"{nbytes:>10,} B after {idle * 1e3:4.0f} ms idle: p50 "
                      f"{statistics.median(times[1:]) * 1e3:8.2f} ms; at the rate "
                      f"{nbytes * 8 / rate * 1e3:8.2f} ms", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
