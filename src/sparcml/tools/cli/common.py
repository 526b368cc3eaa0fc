"""Argument types and helpers shared by the ``sparcml`` commands."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

__all__ = [
    "add_bench_args",
    "add_env_arg",
    "bench_config",
    "fraction_arg",
    "invalid",
    "join_job",
    "positive_arg",
    "size_arg",
]


def size_arg(text: str) -> int:
    """Sizes like 4194304, 4M, 16M, 512K."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4194304, 4M, 512K)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1, got {text!r}")
    return value


def add_env_arg(p: argparse.ArgumentParser) -> None:
    """``--env``: join a torchrun / ``sparcml cluster`` job instead of spawning local ranks."""
    p.add_argument(
        "--env",
        action="store_true",
        help="join a job started by torchrun / sparcml cluster (-P is ignored)",
    )


def fraction_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {v}")
    return v


def positive_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def add_bench_args(p: argparse.ArgumentParser, *, repeats: int, size: str) -> None:
    p.add_argument(
        "-P", "--world-size", type=positive_arg, default=4, help="local ranks (default 4)"
    )
    p.add_argument(
        "-N",
        "--size",
        type=size_arg,
        default=size_arg(size),
        help=f"vector dimension (default {size})",
    )
    p.add_argument(
        "-d", "--density", type=fraction_arg, default=0.01, help="k/N per rank (default 0.01)"
    )
    p.add_argument(
        "--overlap",
        type=fraction_arg,
        default=0.0,
        help="share of each rank's indices drawn from a common hot set (default 0: "
        "independent uniform indices on every rank, the papers' setting)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"]
    )
    p.add_argument(
        "-a",
        "--algorithm",
        action="append",
        default=[],
        help="algorithm to run (repeatable; default: all, plus auto)",
    )
    p.add_argument("--repeats", type=positive_arg, default=repeats, help="timed runs per data set")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument(
        "--experiments", type=positive_arg, default=1, help="fresh data sets (default 1)"
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time the algorithms round robin (one call each per round), so load changes "
        "on a shared machine hit all alike",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-operation timeout, seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def bench_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..bench import BenchConfig

    return BenchConfig(
        world_size=args.world_size,
        size=args.size,
        density=args.density,
        overlap=args.overlap,
        dtype=args.dtype,
        algorithms=tuple(args.algorithm),
        repeats=args.repeats,
        warmup=args.warmup,
        experiments=args.experiments,
        seed=args.seed,
        timeout=args.timeout,
        progress=not args.quiet,
        interleave=args.interleave,
        peers=getattr(args, "peers", False),
    )


def invalid(cfg: Any) -> bool:
    """Validate a configuration; print the CLI's error line and return True if it is bad."""
    try:
        cfg.validate()
    except ValueError as e:
        print(f"sparcml: error: {e}", file=sys.stderr)
        return True
    return False


def join_job(rank_main: Any, cfg: Any, title: str) -> tuple[Any, list[dict[str, Any]] | None]:
    """Run one rank of a benchmark inside a torchrun / ``sparcml cluster`` job.

    Returns the configuration with the job's world size and, on rank 0, the rows
    (None on the other ranks).
    """
    import torch.distributed as dist

    from ...comm import TorchDistCommunicator

    dist.init_process_group("gloo")
    comm = TorchDistCommunicator(timeout=cfg.timeout)
    cfg = dataclasses.replace(cfg, world_size=comm.world_size)
    rows = rank_main(comm, cfg)
    topo = comm.topology
    comm.close()
    dist.destroy_process_group()
    if rows is not None:
        where = os.environ.get("SPARCML_CLUSTER_RATE")
        nodes = "" if topo.is_flat else f", {topo}"
        print(f"{title}: {cfg.world_size} ranks of a torch.distributed job"
              + (f" (emulated cluster, {where} links{nodes})" if where else
                 f" ({topo})" if nodes else ""), flush=True)  # fmt: skip
    return cfg, rows
