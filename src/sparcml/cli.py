"""The ``sparcml`` command line.

* ``sparcml demo`` — the main job: local ranks reduce gradient-like sparse
  vectors with every algorithm and with a dense allreduce, check each result
  against the dense sum and print a table.
* ``sparcml bench`` — the same measurement with more control and CSV/JSON output.
* ``sparcml algorithms`` — the registered algorithms.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _size(text: str) -> int:
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


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {v}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _add_bench_args(p: argparse.ArgumentParser, *, repeats: int, size: str) -> None:
    p.add_argument("-P", "--world-size", type=_positive, default=4, help="local ranks (default 4)")
    p.add_argument(
        "-N", "--size", type=_size, default=_size(size), help=f"vector dimension (default {size})"
    )
    p.add_argument(
        "-d", "--density", type=_fraction, default=0.01, help="k/N per rank (default 0.01)"
    )
    p.add_argument(
        "--overlap",
        type=_fraction,
        default=0.5,
        help="share of each rank's indices drawn from a common hot set (default 0.5)",
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
    p.add_argument("--repeats", type=_positive, default=repeats, help="timed runs per data set")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--experiments", type=_positive, default=1, help="fresh data sets (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-operation timeout, seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def _config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .bench import BenchConfig

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
        peers=getattr(args, "peers", False),
    )


def _bench_plot(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .bench.allreduce import crossovers, plot_sweep, sweep_table

    docs = []
    for f in args.files:
        try:
            docs.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            print(f"sparcml bench-plot: cannot read {f}: {e}", file=sys.stderr)
            return 2
    key = {"P": "world_size", "density": "density"}[args.over]
    if len({d["config"][key] for d in docs}) < 2:
        print(f"sparcml bench-plot: the files must differ in {args.over}", file=sys.stderr)
        return 2
    table, best, series = sweep_table(docs, args.over)
    print(table)
    for line in crossovers(best) or ["no crossover: one algorithm is fastest everywhere"]:
        print("crossover " + line if line.startswith("between") else line)
    if args.out:
        c = docs[0]["config"]
        fixed = f"d={c['density']:g}" if args.over == "P" else f"P={c['world_size']}"
        title = args.title or f"time vs {args.over}, N={c['size']:,}, {fixed}"
        print(f"wrote {plot_sweep(series, args.over, Path(args.out), title)}")
    return 0


def _in_job(rank_main: Any, cfg: Any, title: str) -> tuple[Any, list[dict[str, Any]] | None]:
    """Run one rank of a benchmark inside a torchrun / ``sparcml cluster`` job.

    Returns the configuration with the job's world size and, on rank 0, the rows
    (None on the other ranks).
    """
    import torch.distributed as dist

    from .comm import TorchDistCommunicator

    dist.init_process_group("gloo")
    comm = TorchDistCommunicator(timeout=cfg.timeout)
    cfg = dataclasses.replace(cfg, world_size=comm.world_size)
    rows = rank_main(comm, cfg)
    comm.close()
    dist.destroy_process_group()
    if rows is not None:
        where = os.environ.get("SPARCML_CLUSTER_RATE")
        print(f"{title}: {cfg.world_size} ranks of a torch.distributed job"
              + (f" (emulated cluster, {where} links)" if where else ""), flush=True)  # fmt: skip
    return cfg, rows


def _run(args: argparse.Namespace, title: str) -> int:
    from .bench import format_table, run_benchmark, write_outputs

    cfg = _config(args)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"sparcml: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if getattr(args, "env", False):  # one rank of a torchrun / sparcml cluster job
        from .bench.allreduce import _rank_main

        cfg, got = _in_job(_rank_main, cfg, title)
        if got is None:
            return 0
        rows = got
    else:
        print(
            f"{title}: {cfg.world_size} local ranks over gloo (loopback)",
            file=sys.stderr,
            flush=True,
        )
        rows = run_benchmark(cfg)
    print(format_table(rows, cfg), flush=True)
    print(f"total {time.monotonic() - t0:.1f} s")
    write_outputs(rows, cfg, getattr(args, "json", None), getattr(args, "csv", None))
    return 0 if all(r["correct"] for r in rows) else 1


def _bench_compress(args: argparse.Namespace) -> int:
    import json
    import platform

    from .bench.compress import (
        CompressBenchConfig,
        format_compress_table,
        run_compress_benchmark,
    )

    cfg = CompressBenchConfig(
        sizes_mb=tuple(args.sizes),
        repeats=args.repeats,
        device=args.device,
        threads=args.threads,
        progress=not args.quiet,
    )
    try:
        rows = run_compress_benchmark(cfg)
    except ValueError as e:
        print(f"sparcml: error: {e}", file=sys.stderr)
        return 2
    print(format_compress_table(rows, cfg), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": vars(args), "machine": platform.platform(), "rows": rows}, f, indent=2
            )
    return 0


def _bench_topk(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from .bench.allreduce import format_table, machine_info
    from .bench.topk import TopkBenchConfig, run_topk_benchmark

    cfg = TopkBenchConfig(
        world_size=args.world_size,
        size=args.size,
        density=args.density,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        timeout=args.timeout,
        progress=not args.quiet,
    )
    try:
        cfg.validate()
    except ValueError as e:
        print(f"sparcml: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if args.env:  # one rank of a torchrun / sparcml cluster job
        from .bench.topk import _rank_main

        cfg, got = _in_job(_rank_main, cfg, "sparcml bench-topk")
        if got is None:
            return 0
        rows = got
    else:
        print(f"sparcml bench-topk: {cfg.world_size} local ranks over gloo (loopback)", flush=True)
        rows = run_topk_benchmark(cfg)
    print(format_table(rows, cfg), flush=True)  # type: ignore[arg-type]
    print(f"total {time.monotonic() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            doc = {"config": dataclasses.asdict(cfg), "machine": machine_info(), "rows": rows}
            json.dump(doc, f, indent=2)
    return 0 if all(r["correct"] for r in rows) else 1


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .recipes import RECIPES
    from .recipes.data import DataMissingError
    from .recipes.train import format_table, run_recipe, write_report
    from .torch.state import methods as known_methods

    recipe = RECIPES[args.recipe]
    chosen = args.methods.split(",") if args.methods else list(recipe.methods)
    valid = known_methods()
    for m in chosen:
        parts = m.split("+")
        if m not in valid and not (len(parts) == 2 and all(p in valid for p in parts)):
            print(f"sparcml train: unknown method {m!r}; see `sparcml methods`", file=sys.stderr)
            return 2
    hyper: dict = {"density": args.density}
    if args.warmup_steps:
        hyper["warmup_steps"] = args.warmup_steps
    if args.momentum_correction:
        hyper["momentum"] = args.momentum_correction
    if args.index_coding != "fixed":
        hyper["index_coding"] = args.index_coding
    options: dict = {"limit": args.limit} if args.limit else {}
    if args.fsdp:
        from .torch.fsdp import FSDP_METHODS
        from .torch.state import _kind

        if not args.methods:
            chosen = [m for m in chosen if _kind(m) in FSDP_METHODS]
        for m in chosen:
            if _kind(m) not in FSDP_METHODS:
                print(f"sparcml train: {m!r} has no FSDP reduce-scatter", file=sys.stderr)
                return 2
        options["fsdp"] = True
    command = "sparcml " + " ".join(
        sys.argv[1:] if args.command_line is None else args.command_line
    )
    try:
        result = run_recipe(
            args.recipe, chosen, args.world_size, args.epochs, hyper, args.seed, options,
            progress=not args.quiet,
        )  # fmt: skip
    except DataMissingError as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a rank failed: its traceback is in the message
        if type(e).__name__ != "ProcessFailedError":
            raise
        print(f"sparcml train: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    out = Path(args.out or f"docs/results/train/{args.recipe}")
    for path in write_report(result, out, command):
        print(f"wrote {path}")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from .cluster import ClusterError, cleanup, run_on_cluster

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
    try:
        return run_on_cluster(
            args.world_size, argv, rate=args.rate, port=args.port, timeout=args.timeout,
            log_dir=args.log_dir,
        )  # fmt: skip
    except ClusterError as e:
        print(f"sparcml cluster: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sparcml cluster: interrupted; namespaces removed", file=sys.stderr)
        return 130


def _calibrate(args: argparse.Namespace) -> int:
    import json

    from .calibrate import measure, to_model

    if args.env:  # one rank of a job started by torchrun or sparcml cluster
        import torch.distributed as dist

        from .comm import TorchDistCommunicator

        dist.init_process_group("gloo")
        comm = TorchDistCommunicator()
        figures = measure(comm, args.repeats)
        rank = comm.rank
        comm.close()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from .launch import run_processes

        figures = run_processes(args.world_size, measure, args.repeats, timeout=300)[0]
    model = to_model(figures)
    path = model.save(args.out)
    print(
        f"alpha {model.alpha * 1e6:.1f} us, beta {model.beta * 1e9:.3f} ns/B "
        f"({1 / model.beta / 1e9 if model.beta else float('inf'):.2f} GB/s dense), "
        f"beta_sparse {figures['beta_sparse'] * 1e9:.3f} ns/B, "
        f"gamma {model.gamma * 1e9:.2f} ns/element (dense add {figures['gamma_dense'] * 1e9:.2f})"
    )
    print(f"wrote {path} (algorithm='auto' reads it; SPARCML_CALIBRATION overrides the path)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import json
    import shlex
    from pathlib import Path

    import torch

    from .costmodel import CostModel
    from .simulate import (
        SimConfig,
        format_sim_table,
        quadratic_cost_note,
        run_simulation,
        validate_against,
        write_simulation,
    )

    torch.set_num_threads(1)  # thousands of rank threads: no intra-op pools
    model = CostModel.load(args.calibration) if args.calibration else CostModel.load()
    if args.validate:
        print(f"model: {model.source}")
        print("| measured file | P | algorithm | measured ms | simulated ms | model ms | error |")
        print("|---|---:|---|---:|---:|---:|---:|")
        out = []
        for f in args.validate:
            for r in validate_against(
                Path(f), model, args.quadratic_limit, args.compute, args.cores
            ):
                r["file"] = f
                out.append(r)
                print(
                    f"| {Path(f).name} | {r['P']} | {r['algorithm']} "
                    f"| {r['measured_s'] * 1e3:,.1f} | {r['simulated_s'] * 1e3:,.1f} "
                    f"| {(r['model_s'] or 0) * 1e3:,.1f} | {r['error']:+.0%} |",
                    flush=True,
                )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    cfg = SimConfig(
        world_sizes=tuple(args.world_sizes),
        size=args.size,
        density=args.density,
        overlap=args.overlap,
        algorithms=tuple(a for a in (args.algorithms or "").split(",") if a),
        sim_elements=args.sim_elements,
        quadratic_limit=args.quadratic_limit,
        calibration=args.calibration,
        seed=args.seed,
        progress=not args.quiet,
        compute=args.compute,
        cores=args.cores,
    )
    try:
        cfg.validate()
    except ValueError as e:
        print(f"sparcml simulate: {e}", file=sys.stderr)
        return 2
    rows = run_simulation(cfg)
    print(format_sim_table(rows, model))
    print(quadratic_cost_note(cfg.quadratic_limit))
    if args.out:
        command = "sparcml " + shlex.join(args.command_line or sys.argv[1:])
        for path in write_simulation(rows, cfg, Path(args.out), command):
            print(f"wrote {path}")
    return 0


def _ina_server(args: argparse.Namespace) -> int:
    import logging

    from .ina import AggregatorServer

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
          f"{srv.state_bound / 2**20:.0f} MiB); workers use ina_server='{host}:{port}'"
          f"{' and ina_secret' if secret else ''}; Ctrl-C stops", flush=True)  # fmt: skip
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
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        print("sparcml ina-server: stopped; " + ", ".join(
            f"{k}={v}" for k, v in sorted(srv.snapshot().items())), flush=True)  # fmt: skip
    return 0


def _ina_stats(args: argparse.Namespace) -> int:
    import json
    import socket

    from .ina.packet import HEADER, STATS, STATS_REPLY, Packet, build, parse

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


def _bench_ina(args: argparse.Namespace) -> int:
    import json

    import torch.distributed as dist

    from .bench.ina import format_rows, run_ina_bench

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
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "workers": world - 1, "rate": rate, "rows": rows}, f,
                      indent=2)  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparcml`` command."""
    parser = argparse.ArgumentParser(
        prog="sparcml", description="Sparse and compressed gradient collectives for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="reduce gradient-like sparse vectors on local ranks with every algorithm",
        description="Spawns local ranks (gloo on loopback), reduces gradient-like sparse "
        "vectors with every algorithm and a dense allreduce, checks every result against the "
        "dense sum and prints time, bytes and speedup.",
    )
    _add_bench_args(demo, repeats=5, size="4M")
    bench = sub.add_parser(
        "bench",
        help="sparse allreduce micro-benchmark with CSV/JSON output",
        description="Like demo, with repeated runs over fresh data and machine-readable output.",
    )
    _add_bench_args(bench, repeats=10, size="16M")
    bench.add_argument("--json", help="write results (with config and machine) to this JSON file")
    bench.add_argument("--csv", help="write results to this CSV file")
    bench.add_argument(
        "--peers",
        action="store_true",
        help="also run PyTorch's fp16 and PowerSGD DDP hooks on the same vectors",
    )
    bp = sub.add_parser(
        "bench-plot",
        help="combine bench JSON files into a time-vs-P or time-vs-density log-log plot",
        description="Reads `sparcml bench --json` files that differ in P or in density, prints "
        "p50 per algorithm, the fastest one at each point and the crossovers, and plots.",
    )
    bp.add_argument("files", nargs="+")
    bp.add_argument("--over", choices=["P", "density"], required=True)
    bp.add_argument("--out", help="PNG to write")
    bp.add_argument("--title")
    bench.add_argument(
        "--env",
        action="store_true",
        help="join a job started by torchrun / sparcml cluster (-P is ignored)",
    )
    sub.add_parser("algorithms", help="list the registered sparse allreduce algorithms")
    bt = sub.add_parser(
        "bench-topk",
        help="Ok-Topk against TopkA, TopkDSA, gTopk, Gaussiank and dense allreduce",
        description="Local gloo ranks reduce Gaussian accumulators with every top-k sparse "
        "allreduce (paper 001) and a dense allreduce; prints time, bytes and checks.",
    )
    bt.add_argument("-P", "--world-size", type=_positive, default=4)
    bt.add_argument("-N", "--size", type=_size, default=_size("16M"))
    bt.add_argument("-d", "--density", type=_fraction, default=0.01)
    bt.add_argument("--repeats", type=_positive, default=5)
    bt.add_argument("--warmup", type=int, default=1)
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--timeout", type=float, default=300.0)
    bt.add_argument("--json", help="write the rows to this JSON file")
    bt.add_argument(
        "--env",
        action="store_true",
        help="join a job started by torchrun / sparcml cluster (-P is ignored)",
    )
    bt.add_argument("-q", "--quiet", action="store_true")
    bc = sub.add_parser(
        "bench-compress",
        help="throughput of every compression operator next to a plain copy",
        description="Times compress() of every operator and a clone of the same tensor in one "
        "run (4 MB and 64 MB float32 by default) and checks the throughput targets.",
    )
    bc.add_argument(
        "--sizes", type=_positive, nargs="+", default=[4, 64], help="tensor sizes in MB"
    )
    bc.add_argument("--repeats", type=_positive, default=7)
    bc.add_argument("--device", default="cpu", help="cpu or cuda")
    bc.add_argument("--threads", type=_positive, default=1, help="torch intra-op threads")
    bc.add_argument("--json", help="write the rows to this JSON file")
    bc.add_argument("-q", "--quiet", action="store_true")

    tr = sub.add_parser(
        "train",
        help="train a recipe on real data with dense and each sparcml method",
        description="Trains the recipe's model on local gloo ranks with DDP, once per method "
        "(the method as the DDP communication hook), and writes a results table and plots.",
    )
    from .recipes import RECIPES

    tr.add_argument("recipe", choices=sorted(RECIPES))
    tr.add_argument("--methods", help="comma-separated (default: the recipe's applicable ones)")
    tr.add_argument("-P", "--world-size", type=_positive, default=4)
    tr.add_argument("--epochs", type=_positive, help="default: the recipe's")
    tr.add_argument("-d", "--density", type=_fraction, default=0.01)
    tr.add_argument("--warmup-steps", type=int, default=0, help="dense steps first")
    tr.add_argument(
        "--index-coding",
        choices=["fixed", "delta"],
        default="fixed",
        help="indices of quantized sparse messages: c-byte words or varints of the gaps",
    )
    tr.add_argument(
        "--momentum-correction",
        type=float,
        default=0.0,
        help="DGC momentum correction with this momentum for the sparse methods "
        "(the optimizer then runs without momentum)",
    )
    tr.add_argument("--limit", type=_positive, help="use only this many training examples")
    tr.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard) instead of DDP: the method is the compressed "
        "reduce-scatter (sparcml.torch.register_fsdp)",
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", help="output directory (default docs/results/train/RECIPE)")
    tr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sub.add_parser("methods", help="list the gradient synchronisation methods")
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
        "--slots", type=_positive, default=512,
        help="incomplete chunks per session (and shadow copies kept per session)",
    )  # fmt: skip
    ina.add_argument("--max-sessions", type=_positive, default=16, help="sessions held at once")
    ina.add_argument(
        "--max-slots", type=_positive, default=4096, help="incomplete chunks over all sessions"
    )
    ina.add_argument("--session-timeout", type=float, default=300.0,
                     help="seconds after which an idle session is dropped")  # fmt: skip
    ina.add_argument("--slot-timeout", type=float, default=60.0,
                     help="seconds after which an idle incomplete chunk is dropped")  # fmt: skip
    ina.add_argument(
        "--secret-file",
        help="a file holding the aggregator's secret (1..64 bytes): every session is then "
        "keyed and every packet must carry a valid tag (workers: ina_secret=...)",
    )
    ina.add_argument("--master-rounding", choices=["stochastic", "nearest"], default="stochastic")
    ina.add_argument("--stats-every", type=float, default=10.0, help="seconds between counters")
    bi = sub.add_parser(
        "bench-ina",
        help="the aggregator vs gloo ring all_reduce on the same links (inside sparcml cluster)",
    )
    bi.add_argument("--env", action="store_true", help="join the job (required)")
    bi.add_argument("-N", "--size", type=_size, default=_size("4M"))
    bi.add_argument("--repeats", type=_positive, default=3)
    bi.add_argument("--chunk", type=_positive, default=1024, help="values per packet (<= 1024)")
    bi.add_argument("--json", help="write the rows to this JSON file")
    fz = sub.add_parser("ina-fuzz", help="fuzz the aggregator's packet parser and handler")
    fz.add_argument("--count", type=_positive, default=100_000)
    fz.add_argument("--seed", type=int, default=0)
    fz.add_argument(
        "--flood", action="store_true",
        help="instead: the aggregator's state under session and chunk-id floods, its STATS "
        "reply sizes, and the cost of tags (the figures of docs/ina.md)",
    )  # fmt: skip
    ist = sub.add_parser("ina-stats", help="read a running aggregator's counters")
    ist.add_argument("address", help="host:port of the aggregator")
    ist.add_argument(
        "--pad",
        type=int,
        default=1400,
        metavar="BYTES",
        help="request size, 64..8192: the reply is never longer (default 1400)",
    )
    si = sub.add_parser(
        "simulate",
        help="the real collectives on a virtual clock under the calibrated model, up to P=4096",
        description="Runs every algorithm on P simulated ranks (threads) whose transport keeps "
        "time by the alpha-beta-gamma model; data scaled down N/s, costs charged at N. Prints "
        "simulated and closed-form times, bytes and fill-in; --validate compares with a "
        "measured `sparcml bench --json` file.",
    )
    si.add_argument(
        "-P",
        "--world-sizes",
        type=_positive,
        nargs="+",
        default=[4, 8, 16, 64, 256, 1024, 4096],
    )
    si.add_argument("-N", "--size", type=_size, default=_size("16M"))
    si.add_argument("-d", "--density", type=_fraction, default=0.00781)
    si.add_argument("--overlap", type=_fraction, default=0.0, help="share from a common hot set")
    si.add_argument("--algorithms", help="comma-separated (default: all simulated ones)")
    si.add_argument("--calibration", help="calibration JSON (default: the stored one)")
    si.add_argument(
        "--sim-elements",
        type=_size,
        default=_size("64M"),
        help="memory budget: scaled elements over all ranks (default 64M)",
    )
    si.add_argument("--quadratic-limit", type=_positive, default=1024,
                    help="largest P for P^2-work algorithms (model beyond)")  # fmt: skip
    si.add_argument(
        "--compute",
        choices=["model", "measured"],
        default="model",
        help="local work: gamma per element (model) or timed for real (measured)",
    )
    si.add_argument(
        "--cores",
        type=_positive,
        help="measured compute: cores the P ranks share on the predicted machine",
    )
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--out", help="write simulate.md/.json/.png into this directory")
    si.add_argument("--validate", nargs="+", metavar="BENCH_JSON",
                    help="simulate these measured bench runs and report the error")  # fmt: skip
    si.add_argument("--json", help="with --validate: write the comparison here")
    si.add_argument("-q", "--quiet", action="store_true")
    ca = sub.add_parser(
        "calibrate",
        help="measure alpha, beta and gamma for algorithm='auto'",
        description="Ping-pong, dense allreduce and local reduction timings fitted to the "
        "alpha-beta-gamma model; stored where algorithm='auto' finds them.",
    )
    ca.add_argument("-P", "--world-size", type=_positive, default=2, help="local ranks")
    ca.add_argument(
        "--env",
        action="store_true",
        help="join a job started by torchrun / sparcml cluster instead of spawning",
    )
    ca.add_argument("--repeats", type=_positive, default=7)
    ca.add_argument("--out", help="calibration file (default $SPARCML_CALIBRATION or "
                    "~/.config/sparcml/calibration.json)")  # fmt: skip
    ca.add_argument("--json", help="also write every measurement to this file")
    cl = sub.add_parser(
        "cluster",
        help="run a command on P emulated hosts with rate-shaped links (root)",
        description="Creates P network namespaces on a bridge, shapes every link with tc tbf, "
        "runs the command once per host as one torch.distributed rank (env:// variables set) "
        "and always tears everything down.",
    )
    cl.add_argument("-P", "--world-size", type=_positive, default=4)
    cl.add_argument("--rate", default="1gbit", help="per-link rate in tc syntax (default 1gbit)")
    cl.add_argument("--port", type=int, default=29500, help="MASTER_PORT on host 0")
    cl.add_argument("--timeout", type=float, help="stop every rank after this many seconds")
    cl.add_argument("--log-dir", help="also write each rank's output to LOG_DIR/rank<i>.log")
    cl.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed run")
    cl.add_argument("--prefix", default="spcl", help=argparse.SUPPRESS)
    cl.add_argument("argv", nargs=argparse.REMAINDER, help="-- command and arguments")

    args = parser.parse_args(argv)
    args.command_line = list(argv) if argv is not None else None
    if args.command == "train":
        return _train(args)
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "bench-plot":
        return _bench_plot(args)
    if args.command == "ina-server":
        return _ina_server(args)
    if args.command == "ina-stats":
        return _ina_stats(args)
    if args.command == "bench-ina":
        return _bench_ina(args)
    if args.command == "ina-fuzz":
        import logging

        from .ina.fuzz import fuzz

        logging.getLogger("sparcml.ina").setLevel(logging.ERROR)
        if args.flood:
            import json

            from .ina.fuzz import flood

            print(json.dumps(flood(seed=args.seed), indent=2))
            return 0
        print(fuzz(args.count, args.seed))
        return 0
    if args.command == "methods":
        from .torch.state import methods

        for name, text in methods().items():
            print(f"{name:<28} {text}")
        return 0
    if args.command == "algorithms":
        from .collectives import algorithms

        exact, topk = algorithms(exact=True), algorithms(exact=False)
        print("sum of the inputs:  " + ", ".join([*exact, "auto"]))
        print("top-k family:       " + ", ".join(topk))
        return 0
    if args.command == "bench-compress":
        return _bench_compress(args)
    if args.command == "bench-topk":
        return _bench_topk(args)
    if args.command == "demo":
        return _run(args, "sparcml demo")
    return _run(args, "sparcml bench")


if __name__ == "__main__":
    sys.exit(main())
