"""The emulated cluster and calibration: ``calibrate``, ``cluster``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import add_env_arg, positive_arg

__all__ = ["add_parsers"]


def calibrate(args: argparse.Namespace) -> int:

    from ..calibrate import fit, measure, to_model

    if args.refit:  # the measurements of an earlier calibration, fitted again
        import json

        try:
            with open(args.refit) as f:
                stored = json.load(f)
            figures = fit(stored.get("rows", stored))
        except (OSError, ValueError, AttributeError) as e:
            print(f"sparcml calibrate: --refit {args.refit}: {e}", file=sys.stderr)
            return 2
    elif args.env:  # one rank of a job started by torchrun or sparcml cluster
        import torch.distributed as dist

        from ...comm import TorchDistCommunicator

        dist.init_process_group("gloo")
        comm = TorchDistCommunicator()
        figures = measure(comm, args.repeats)
        rank = comm.rank
        comm.close()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from ...comm.launch import run_processes

        figures = run_processes(args.world_size, measure, args.repeats, timeout=300)[0]
    model = to_model(figures)
    path = model.save(args.out)
    print(
        f"alpha {model.alpha * 1e6:.1f} us, beta {model.beta * 1e9:.3f} ns/B "
        f"({1 / model.beta / 1e9 if model.beta else float('inf'):.2f} GB/s dense), "
        f"beta_sparse {figures['beta_sparse'] * 1e9:.3f} ns/B, "
        f"gamma {model.gamma * 1e9:.2f} ns/element (dense add {figures['gamma_dense'] * 1e9:.2f})"
    )
    where = figures.get("topology", "topology not recorded")
    print(f"inside a node: alpha {model.alpha_intra * 1e6:.1f} us, beta "
          f"{model.beta_intra * 1e9:.3f} ns/B ({where})")  # fmt: skip
    print(f"wrote {path} (algorithm='auto' reads it; SPARCML_CALIBRATION overrides the path)")
    if args.json:
        from ..bench.harness import write_json

        write_json(args.json, "calibrate", figures, vars(args))
    return 0


def cluster(args: argparse.Namespace) -> int:
    from ..cluster import ClusterError, cleanup, link_options, run_on_cluster

    if args.cleanup:
        gone = cleanup(args.prefix)
        print(f"removed {len(gone)} namespaces" + (f": {', '.join(gone)}" if gone else ""))
        return 0
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("sparcml cluster: give the command after --, e.g. "
              "sparcml cluster -P 4 -- python train.py", file=sys.stderr)  # fmt: skip
        return 2
    hosts, per = args.world_size, 1
    if args.nodes is not None or args.ranks_per_node is not None:
        per = args.ranks_per_node or 1
        if args.nodes is None:
            if args.world_size % per:
                print(f"sparcml cluster: -P {args.world_size} is not a multiple of "
                      f"--ranks-per-node {per}", file=sys.stderr)  # fmt: skip
                return 2
            hosts = args.world_size // per
        else:
            hosts = args.nodes
    try:
        link_options(args.rate)
    except ValueError as e:  # a rate or bucket tc would not read
        print(f"sparcml cluster: {e}", file=sys.stderr)
        return 2
    try:
        return run_on_cluster(
            hosts, argv, rate=args.rate, port=args.port, timeout=args.timeout,
            log_dir=args.log_dir, ranks_per_node=per,
        )  # fmt: skip
    except ClusterError as e:
        print(f"sparcml cluster: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sparcml cluster: interrupted; namespaces removed", file=sys.stderr)
        return 130


def add_parsers(sub: Any) -> None:
    """Register this family's commands on the ``sparcml`` subparsers."""
    ca = sub.add_parser(
        "calibrate",
        help="measure alpha, beta and gamma for algorithm='auto'",
        description="Ping-pong, dense allreduce and local reduction timings fitted to the "
        "alpha-beta-gamma model; stored where algorithm='auto' finds them.",
    )
    ca.add_argument("-P", "--world-size", type=positive_arg, default=2, help="local ranks")
    add_env_arg(ca)
    ca.add_argument("--repeats", type=positive_arg, default=7)
    ca.add_argument("--out", help="calibration file (default $SPARCML_CALIBRATION or "
                    "~/.config/sparcml/calibration.json)")  # fmt: skip
    ca.add_argument("--json", help="also write every measurement to this file")
    ca.add_argument("--refit", metavar="FIGURES",
                    help="measure nothing: fit the measurements an earlier calibration wrote "
                    "with --json again (the model's fit of this version)")  # fmt: skip
    ca.set_defaults(run=calibrate)
    cl = sub.add_parser(
        "cluster",
        help="run a command on P emulated hosts with rate-shaped links (root)",
        description="Creates P network namespaces on a bridge, shapes every link with tc tbf, "
        "runs the command once per host as one torch.distributed rank (env:// variables set) "
        "and always tears everything down.",
    )
    cl.add_argument("-P", "--world-size", type=positive_arg, default=4,
                    help="ranks, one host each (default 4); see --nodes")  # fmt: skip
    cl.add_argument("--nodes", type=positive_arg,
                    help="hosts (nodes), each with --ranks-per-node ranks sharing its one "
                    "shaped NIC and talking to each other unshaped (overrides -P)")  # fmt: skip
    cl.add_argument("--ranks-per-node", type=positive_arg,
                    help="ranks per host (default 1); GROUP_RANK, LOCAL_RANK and "
                    "LOCAL_WORLD_SIZE are set as torchrun sets them")  # fmt: skip
    cl.add_argument("--rate", default="1gbit", help="per-link rate in tc syntax (default 1gbit)")
    cl.add_argument("--port", type=int, default=29500, help="MASTER_PORT on host 0")
    cl.add_argument("--timeout", type=float, help="stop every rank after this many seconds")
    cl.add_argument("--log-dir", help="also write each rank's output to LOG_DIR/rank<i>.log")
    cl.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed run")
    cl.add_argument("--prefix", default="spcl", help=argparse.SUPPRESS)
    cl.add_argument("argv", nargs=argparse.REMAINDER, help="-- command and arguments")
    cl.set_defaults(run=cluster)
