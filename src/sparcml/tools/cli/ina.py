"""In-network aggregation: ``ina-server``, ``bench-ina``, ``ina-fuzz``, ``ina-stats``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from .common import positive_arg, size_arg

__all__ = ["add_parsers"]


def ina_server(args: argparse.Namespace) -> int:
    import logging

    from ...ina import AggregatorServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    secret = None
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = f.read().strip()
        if not 1 <= len(secret) <= 64:
            print(f"sparcml ina-server: {args.secret_file}: the secret must be 1..64 bytes, "
                  f"got {len(secret)}", file=sys.stderr)  # fmt: skip
            return 2
    srv = AggregatorServer(
        args.host, args.port, args.slots, args.master_rounding,
        max_sessions=args.max_sessions, max_slots=args.max_slots,
        session_timeout=args.session_timeout, slot_timeout=args.slot_timeout, secret=secret,
    )  # fmt: skip
    host, port = srv.address
    print(f"sparcml ina-server: listening on {host}:{port} (epoch {srv.epoch}, "
          f"{'keyed sessions' if secret else 'token sessions'}, state at most "
          f"{srv.state_bound / 2**20:.0f} MiB); workers use server='{host}:{port}'"
          f"{' and secret' if secret else ''}; Ctrl-C stops", flush=True)  # fmt: skip
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    srv.start()
    try:
        while True:
            time.sleep(args.stats_every)
            print("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(srv.snapshot().items())),
                  flush=True)  # fmt: skip
            if not srv.serving:  # (its log says why)
                print("sparcml ina-server: the serving thread stopped", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        print("sparcml ina-server: stopped; " + ", ".join(
            f"{k}={v}" for k, v in sorted(srv.snapshot().items())), flush=True)  # fmt: skip
    return 0


def ina_stats(args: argparse.Namespace) -> int:
    import json
    import socket

    from ...ina.packet import HEADER, STATS, STATS_REPLY, Packet, build, parse

    if not 64 <= args.pad <= 8192:
        print(f"sparcml ina-stats: --pad must be in 64..8192, got {args.pad}", file=sys.stderr)
        return 2
    host, _, port = args.address.rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    # the aggregator never answers with more bytes than it got: pad the request
    pad = bytes(args.pad - HEADER.size)
    s.sendto(build(Packet(STATS, 0, 0, 0, 1, 0, 0, 0, pad)), (host, int(port)))
    try:
        p = parse(s.recv(65535))
    except (TimeoutError, OSError, ValueError):
        print(f"sparcml ina-stats: no answer from {args.address}", file=sys.stderr)
        return 1
    finally:
        s.close()
    if p.kind != STATS_REPLY:
        print("sparcml ina-stats: unexpected answer", file=sys.stderr)
        return 1
    if not p.payload:
        print(f"sparcml ina-stats: the counters do not fit in {args.pad} bytes: use a larger "
              "--pad", file=sys.stderr)  # fmt: skip
        return 1
    print(json.dumps(json.loads(p.payload), indent=2))
    return 0


def bench_ina(args: argparse.Namespace) -> int:

    import torch.distributed as dist

    from ..bench.ina import format_rows, run_ina_bench

    if not args.env:
        print("sparcml bench-ina: run it inside a job, e.g. sudo sparcml cluster -P 5 --rate "
              "1gbit -- sparcml bench-ina --env (the last host is the aggregator)",
              file=sys.stderr)  # fmt: skip
        return 2
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = run_ina_bench(args.size, args.repeats, args.chunk)
    dist.destroy_process_group()
    if rows is None:
        return 0
    rate = os.environ.get("SPARCML_CLUSTER_RATE", "?")
    print(format_rows(rows, args.size, world - 1, rate), flush=True)
    if args.json:
        config = {"size": args.size, "workers": world - 1, "rate": rate}
        from ..bench.harness import write_json

        write_json(args.json, "bench-ina", rows, config, transport="UDP to the aggregator")
    return 0


def ina_fuzz(args: argparse.Namespace) -> int:
    import logging

    from ...ina.fuzz import fuzz

    logging.getLogger("sparcml.ina").setLevel(logging.ERROR)
    if args.flood:
        import json

        from ...ina.fuzz import flood

        print(json.dumps(flood(seed=args.seed), indent=2))
        return 0
    print(fuzz(args.count, args.seed))
    return 0


def add_parsers(sub: Any) -> None:
    """Register this family's commands on the ``sparcml`` subparsers."""
    ina = sub.add_parser(
        "ina-server",
        help="run the in-network aggregation service (integer-only aggregator)",
        description="An aggregator emulating a SwitchML-style switch: sums workers' chunks of "
        "natural-compression codes (or fixed-point integers) as int64, re-compresses the sum "
        "and sends it back; rejects and counts malformed packets; prints its counters.",
    )
    ina.add_argument("--host", default="127.0.0.1")
    ina.add_argument("--port", type=int, default=47000, help="UDP port (0: any free port)")
    ina.add_argument(
        "--slots", type=positive_arg, default=512,
        help="incomplete chunks per session (and shadow copies kept per session)",
    )  # fmt: skip
    ina.add_argument("--max-sessions", type=positive_arg, default=16, help="sessions held at once")
    ina.add_argument(
        "--max-slots", type=positive_arg, default=4096, help="incomplete chunks over all sessions"
    )
    ina.add_argument("--session-timeout", type=float, default=300.0,
                     help="seconds after which an idle session is dropped")  # fmt: skip
    ina.add_argument("--slot-timeout", type=float, default=60.0,
                     help="seconds after which an idle incomplete chunk is dropped")  # fmt: skip
    ina.add_argument(
        "--secret-file",
        help="a file holding the aggregator's secret (1..64 bytes): every session is then "
        "keyed and every packet must carry a valid tag (workers: secret=...)",
    )
    ina.add_argument("--master-rounding", choices=["stochastic", "nearest"], default="stochastic")
    ina.add_argument("--stats-every", type=float, default=10.0, help="seconds between counters")
    ina.set_defaults(run=ina_server)
    bi = sub.add_parser(
        "bench-ina",
        help="the aggregator vs gloo ring all_reduce on the same links (inside sparcml cluster)",
    )
    bi.add_argument("--env", action="store_true", help="join the job (required)")
    bi.add_argument("-N", "--size", type=size_arg, default=size_arg("4M"))
    bi.add_argument("--repeats", type=positive_arg, default=3)
    bi.add_argument("--chunk", type=positive_arg, default=1024, help="values per packet (<= 1024)")
    bi.add_argument("--json", help="write the rows to this JSON file")
    bi.set_defaults(run=bench_ina)
    fz = sub.add_parser("ina-fuzz", help="fuzz the aggregator's packet parser and handler")
    fz.add_argument("--count", type=positive_arg, default=100_000)
    fz.add_argument("--seed", type=int, default=0)
    fz.add_argument(
        "--flood", action="store_true",
        help="instead: the aggregator's state under session and chunk-id floods, its STATS "
        "reply sizes, and the cost of tags (the figures of docs/ina.md)",
    )  # fmt: skip
    fz.set_defaults(run=ina_fuzz)
    ist = sub.add_parser("ina-stats", help="read a running aggregator's counters")
    ist.add_argument("address", help="host:port of the aggregator")
    ist.add_argument(
        "--pad",
        type=int,
        default=1400,
        metavar="BYTES",
        help="request size, 64..8192: the reply is never longer (default 1400)",
    )
    ist.set_defaults(run=ina_stats)
