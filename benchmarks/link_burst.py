r"""What the emulated link lets through at once: one exchange (both ranks send and
receive the same size at the same time) between two ranks, after the link idled and
back to back, against the bytes' time at the rate.

``tc tbf`` sends a full bucket at once where a real link serialises every byte at
its rate. ``sparcml cluster`` serialises links slower than 250 Mbit/s (a bucket of
1.25 ms of the link, segmentation offloads off); faster links, and any link when
``$SPARCML_CLUSTER_BURST`` names a bucket, keep a plain bucket (256 KB by default)
with the offloads on (docs/cluster.md, "The token bucket's burst")::

    sparcml cluster -P 2 --rate 100mbit -- python benchmarks/link_burst.py --rate 100mbit
    SPARCML_CLUSTER_BURST=256kb sparcml cluster -P 2 --rate 100mbit -- \
        python benchmarks/link_burst.py --rate 100mbit

``--transport tcp`` (the default) exchanges over one plain TCP connection (a thread
sends while the caller receives): the link alone. ``--transport gloo`` uses
``isend``/``irecv`` of torch.distributed's gloo (``--recv-first``: ``irecv`` first),
which adds its own behaviour (at 100 Mbit/s some 4 MB exchanges took twice their
time: one direction after the other, docs/cluster.md, "Exchanges over gloo");
``--transport sparcml`` sparcml's ``Communicator.sendrecv``. Rank 0 prints each
size's median and range over ``--calls`` exchanges.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from sparcml.tools.cli.common import size_arg
from sparcml.tools.cluster import parse_rate

PORT_OFFSET = 17  # the plain TCP connection's port: MASTER_PORT + this


def tcp_exchange(me: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(exchange of n bytes, a small round trip) over one TCP connection to the other rank."""
    port = int(os.environ.get("MASTER_PORT", "29500")) + PORT_OFFSET
    if me == 0:
        with socket.create_server(("0.0.0.0", port)) as server:
            dist.barrier()
            sock, _ = server.accept()
    else:
        dist.barrier()
        sock = socket.create_connection((os.environ["MASTER_ADDR"], port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive(n: int) -> None:
        view = memoryview(bytearray(n))
        got = 0
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the other rank closed the connection")
            got += k

    def exchange(n: int) -> None:
        sender = threading.Thread(target=sock.sendall, args=(bytes(n),))
        sender.start()
        receive(n)
        sender.join()

    def round_trip() -> None:
        sock.sendall(b"x")
        receive(1)

    return exchange, round_trip


def gloo_exchange(me: int, recv_first: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(exchange of n bytes with gloo's isend + irecv, or irecv + isend; a barrier)."""
    bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def exchange(n: int) -> None:
        if n not in bufs:
            bufs[n] = (torch.zeros(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
        snd, rcv = bufs[n]
        if recv_first:
            works = [dist.irecv(rcv, 1 - me), dist.isend(snd, 1 - me)]
        else:
            works = [dist.isend(snd, 1 - me), dist.irecv(rcv, 1 - me)]
        for work in works:
            work.wait()

    return exchange, dist.barrier


def sparcml_exchange(me: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(exchange of n bytes with sparcml's ``Communicator.sendrecv`` over gloo, a barrier)."""
    from sparcml.comm import TorchDistCommunicator

    comm = TorchDistCommunicator()
    bufs: dict[int, torch.Tensor] = {}

    def exchange(n: int) -> None:
        if n not in bufs:
            bufs[n] = torch.zeros(n, dtype=torch.uint8)
        comm.sendrecv(bufs[n], 1 - me)

    return exchange, comm.barrier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", required=True, help="the cluster's link rate (tc syntax)")
    ap.add_argument("--sizes", default="92774,377690,4M", help="bytes, comma-separated")
    ap.add_argument("--idle-ms", type=float, default=15.0, help="idle time before a call")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--transport", choices=("tcp", "gloo", "sparcml"), default="tcp")
    ap.add_argument("--recv-first", action="store_true", help="gloo: post irecv before isend")
    args = ap.parse_args()
    rate = parse_rate(args.rate)
    dist.init_process_group("gloo")
    me, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise SystemExit("link_burst.py runs on 2 ranks (sparcml cluster -P 2)")
    if args.transport == "tcp":
        exchange, sync = tcp_exchange(me)
    elif args.transport == "gloo":
        exchange, sync = gloo_exchange(me, args.recv_first)
    else:
        exchange, sync = sparcml_exchange(me)
    if me == 0:
        link = os.environ.get("SPARCML_CLUSTER_LINK", "(not on sparcml cluster)")
        how = args.transport + (" (irecv first)" if args.recv_first else "")
        print(f"{args.rate} links: {link}; {how}, {args.calls} exchanges each, "
              "rank 0's p50 [min..max]", flush=True)  # fmt: skip
    for nbytes in (size_arg(s) for s in args.sizes.split(",")):
        for idle in (args.idle_ms / 1e3, 0.0):
            times = []
            for _ in range(args.calls + 1):
                sync()
                time.sleep(idle)
                sync()
                t = time.perf_counter()
                exchange(nbytes)
                times.append(time.perf_counter() - t)
            ms = sorted(x * 1e3 for x in times[1:])
            if me == 0:
                print(f"{nbytes:>10,} B after {idle * 1e3:4.0f} ms idle: p50 "
                      f"{statistics.median(ms):8.2f} ms [{ms[0]:.2f}..{ms[-1]:.2f}]; at the rate "
                      f"{nbytes * 8 / rate * 1e3:8.2f} ms", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
