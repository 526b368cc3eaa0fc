"""Benchmarks: ``demo``, ``bench``, ``bench-plot``, ``algorithms``, ``bench-topk``,
``bench-compress``, ``bench-gpu``, ``bench-faults``, ``bench-local``, ``bench-mpi``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from .common import (
    add_bench_args,
    add_env_arg,
    bench_config,
    fraction_arg,
    invalid,
    join_job,
    positive_arg,
    size_arg,
)

__all__ = ["add_parsers"]


def bench_plot(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..bench.allreduce import crossovers, plot_sweep, sweep_table

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


def run_bench(args: argparse.Namespace, title: str) -> int:
    from ..bench import format_table, run_benchmark, write_outputs

    cfg = bench_config(args)
    if invalid(cfg):
        return 2
    t0 = time.monotonic()
    if getattr(args, "env", False):  # one rank of a torchrun / sparcml cluster job
        from ..bench.allreduce import rank_main

        cfg, got = join_job(rank_main, cfg, title)
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
    return 0 if all(r["correct"] is not False for r in rows) else 1


def bench_gpu(args: argparse.Namespace) -> int:
    from ..bench.gpu import (
        GpuBenchConfig,
        device_name,
        format_gpu_tables,
        gpu_targets,
        rows_of,
        run_gpu_benchmark,
    )

    cfg = GpuBenchConfig(
        device=args.device,
        mb=args.mb,
        densities=tuple(args.densities),
        stream_density=args.stream_density,
        world=args.world,
        repeats=args.repeats,
        progress=not args.quiet,
    )
    try:
        tables = run_gpu_benchmark(cfg)
    except ValueError as e:
        print(f"sparcml bench-gpu: error: {e}", file=sys.stderr)
        return 2
    print(format_gpu_tables(tables, cfg), flush=True)
    if args.json:
        from ..bench.harness import write_json

        write_json(
            args.json,
            "bench-gpu",
            rows_of(tables),
            dataclasses.asdict(cfg),
            device=device_name(cfg.device),
        )
    missed = [what for what, _, _, met in gpu_targets(tables) if not met]
    if missed:
        print(f"sparcml bench-gpu: {len(missed)} target(s) NOT met", file=sys.stderr)
    if tables["failures"]:
        print(f"sparcml bench-gpu: {len(tables['failures'])} kernel(s) FAILED", file=sys.stderr)
        return 1
    return 0


def bench_compress(args: argparse.Namespace) -> int:
    from ..bench.compress import (
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
    from ..bench.compress import check_targets

    print(format_compress_table(rows, cfg), flush=True)
    if args.json:
        from ..bench.harness import write_json

        write_json(args.json, "bench-compress", rows, dataclasses.asdict(cfg))
    missed = [what for what, _, _, met in check_targets(rows) if not met]
    if missed:
        print(f"sparcml bench-compress: {len(missed)} target(s) NOT met", file=sys.stderr)
        return 1
    return 0


def bench_topk(args: argparse.Namespace) -> int:
    import dataclasses

    from ..bench.allreduce import format_table
    from ..bench.topk import TopkBenchConfig, run_topk_benchmark

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
    if invalid(cfg):
        return 2
    t0 = time.monotonic()
    if args.env:  # one rank of a torchrun / sparcml cluster job
        from ..bench.topk import rank_main

        cfg, got = join_job(rank_main, cfg, "sparcml bench-topk")
        if got is None:
            return 0
        rows = got
    else:
        print(f"sparcml bench-topk: {cfg.world_size} local ranks over gloo (loopback)", flush=True)
        rows = run_topk_benchmark(cfg)
    print(format_table(rows, cfg), flush=True)  # type: ignore[arg-type]
    print(f"total {time.monotonic() - t0:.1f} s")
    if args.json:
        from ..bench.harness import write_json

        write_json(args.json, "bench-topk", rows, dataclasses.asdict(cfg))
    return 0 if all(r["correct"] is not False for r in rows) else 1


def bench_faults(args: argparse.Namespace) -> int:
    import statistics

    from ..bench.faults import MISMATCHES, SCENARIOS, run_fault, run_mismatch

    scenarios = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    modes = args.modes.split(",")
    report: dict[str, Any] = {"faults": [], "mismatches": []}
    bad = 0
    summary = []
    for scenario in scenarios if args.runs else []:
        for mode in modes:
            runs = []
            for i in range(args.runs):
                # P = 3 and 4 alternating; the victim cycles through every rank, 0 included
                world = 3 + i % 2
                r = run_fault(scenario, mode, world, i, timeout=args.timeout,
                              victim=(i // 2) % world)  # fmt: skip
                runs.append(r)
                wrong = {k: (o.get("type"), o.get("peer")) for k, o in r.survivors.items()
                         if o.get("peer") != r.victim or r.wrong_type}  # fmt: skip
                t = r.seconds_to_error
                print(f"{scenario:<32} {mode:<4} P={r.world} victim={r.victim} after "
                      f"{r.after:>2} msgs: {r.right}/{r.world - 1} right"
                      + (" HANG" if r.hang else "") + (f" {wrong}" if wrong else "")
                      + (f", error {t:.2f} s after the fault" if t is not None else ""),
                      flush=True)  # fmt: skip
                report["faults"].append({**dataclasses.asdict(r), "seconds_to_error": t})
            times = [r.seconds_to_error for r in runs if r.seconds_to_error is not None]
            row = (scenario, mode, len(runs), sum(r.hang for r in runs),
                   sum(r.wrong_rank for r in runs), sum(r.wrong_type for r in runs),
                   statistics.median(times) if times else float("nan"),
                   max(times, default=float("nan")))  # fmt: skip
            summary.append(row)
            bad += row[3] + row[4] + row[5]
    mism = []
    worlds = [int(w) for w in args.mismatch_worlds.split(",") if w]
    for case in [*MISMATCHES, "raises"]:
        for world in worlds:
            m = run_mismatch(case, world, timeout=args.timeout)
            late = m.seconds > 1.0
            print(f"mismatch {case:<20} P={world}: {m.right}/{world} ranks right"
                  + (" HANG" if m.hang else "") + f", {m.seconds:.2f} s"
                  + (" (over 1 s)" if late else ""), flush=True)  # fmt: skip
            report["mismatches"].append({**dataclasses.asdict(m), "seconds": m.seconds})
            mism.append((case, world, m.right, m.hang, m.seconds))
            bad += (world - m.right) + m.hang + late
    if summary:
        print(f"\n{'scenario':<32} {'mode':<4} {'runs':>4} {'hangs':>5} {'wrong rank':>10} "
              f"{'wrong type':>10} {'s to error p50':>14} {'max':>6}")  # fmt: skip
        for sc, mode, n, hangs, wr, wt, p50, mx in summary:
            print(f"{sc:<32} {mode:<4} {n:>4} {hangs:>5} {wr:>10} {wt:>10} {p50:>14.2f} "
                  f"{mx:>6.2f}")  # fmt: skip
        print("(wrong rank / wrong type: survivors, summed over the runs; the type a kill "
              "must give is PeerFailedError, a freeze CommTimeoutError; time from the "
              f"victim's fault to the last survivor's error, communicator timeout "
              f"{args.timeout:g} s)")  # fmt: skip
    if mism:
        print(f"\n{'mismatch':<20} " + " ".join(f"{'P=' + str(w):>14}" for w in worlds))
        for case in [*MISMATCHES, "raises"]:
            cells = [f"{right}/{w} {'HANG' if hang else f'{s:.2f} s':>7}"
                     for c, w, right, hang, s in mism if c == case]  # fmt: skip
            print(f"{case:<20} " + " ".join(f"{c:>14}" for c in cells))
        print(
            "(ranks that raised the documented error / all ranks, and the slowest rank's "
            "time to its error; target: all, within 1 s)"
        )
    if args.json:
        from ..bench.harness import write_json

        write_json(args.json, "bench-faults", report["faults"] + report["mismatches"],
                   {"runs": args.runs, "timeout": args.timeout, "scenarios": scenarios,
                    "modes": modes, "mismatch_worlds": worlds})  # fmt: skip
    return 1 if bad else 0


def bench_local(args: argparse.Namespace) -> int:
    import torch

    from ..bench.local import collective_rows, copy_bandwidth, kernel_rows

    torch.set_num_threads(1)
    n, p, d = args.size, args.world_size, args.density
    print(f"N={n:,} P={p} d={d:g}, one torch thread, uniform independent indices; "
          f"copy bandwidth {copy_bandwidth() / 1e9:.1f} GB/s (read + write)")  # fmt: skip
    print()
    print(f"{'kernel':<52} {'elements':>9} {'ms':>7} {'ns/elem':>8} {'bound ms':>9}")
    for r in kernel_rows(n, p, d, args.reps):
        print(f"{r['kernel']:<52} {r['elements']:>9,} {r['ms']:>7.2f} "
              f"{r['ns_per_element']:>8.1f} {r['bound_ms']:>9.2f}")  # fmt: skip
    print()
    print(f"CPU ms per rank per call: 'shared' = the {p} ranks run together on this "
          f"machine's {os.cpu_count()} cores; 'alone' = they take turns (one computes at a "
          "time, as on a core of its own)")  # fmt: skip
    print(f"{'algorithm (per rank per call)':<30} {'result nnz':>10} {'alone p50':>10} "
          f"{'alone max':>10} {'shared p50':>10} {'shared max':>10} {'bound MB':>9} "
          f"{'bound ms':>9}")  # fmt: skip
    for r in collective_rows(n, p, d, args.calls, tuple(args.algorithms.split(","))):
        print(f"{r['algorithm']:<30} {r['result_nnz']:>10,} {r['alone_cpu_ms_median']:>10.1f} "
              f"{r['alone_cpu_ms_max']:>10.1f} {r['cpu_ms_median']:>10.1f} "
              f"{r['cpu_ms_max']:>10.1f} {r['rank_bound_bytes'] / 1e6:>9.1f} "
              f"{r['bound_ms']:>9.2f}")  # fmt: skip
    return 0


def bench_mpi(args: argparse.Namespace) -> int:
    import json
    import os

    from ...comm import MPICommunicator, mpi_available
    from ...comm.hostmem import VARIABLE

    if not mpi_available():
        print("sparcml bench-mpi: needs mpi4py (pip install 'sparcml[mpi]')", file=sys.stderr)
        return 2
    from ..bench.mpi import dense_rows

    comm = MPICommunicator(timeout=args.timeout)
    if comm.world_size < 2:
        print("sparcml bench-mpi: run it under mpirun, e.g. "
              "mpirun -np 4 sparcml bench-mpi", file=sys.stderr)  # fmt: skip
        return 2
    rows = dense_rows(comm, args.sizes, args.repeats)
    if comm.rank == 0:
        print(f"dense allreduce, float32, P={comm.world_size}, median of {args.repeats} "
              f"(slowest rank per call); {VARIABLE}={os.environ.get(VARIABLE, '')}")  # fmt: skip
        print(f"{'N':>12} {'MB':>7} {'sparcml ms':>11} {'mpi4py ms':>10} "
              f"{'fresh-out ms':>13} {'sparcml/mpi4py':>15} {'vs fresh-out':>13}")  # fmt: skip
        for r in rows:
            print(f"{r['N']:>12,} {r['bytes'] / 1e6:>7.1f} {r['sparcml_ms']:>11.2f} "
                  f"{r['mpi4py_ms']:>10.2f} {r['mpi4py_fresh_out_ms']:>13.2f} "
                  f"{r['ratio']:>14.2f}x {r['ratio_fresh_out']:>12.2f}x")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": comm.world_size, "rows": rows}, f, indent=1)
            print(f"wrote {args.json}")
    comm.close()
    return 0


def list_algorithms(args: argparse.Namespace) -> int:
    from ...collectives import algorithms
    from ...collectives.registry import describe

    exact, topk = algorithms(exact=True), algorithms(exact=False)
    print("sum of the inputs:  " + ", ".join([*exact, "auto"]))
    print("top-k family:       " + ", ".join(topk))
    print()
    rows = describe()
    w = max(22, *(len(r["name"]) for r in rows))
    print(f"{'name':<{w}} {'exact':<6} {'input':<12} {'auto':<5} {'options':<8} summary")
    for r in rows:
        alias = f" (= {r['alias_of']})" if r["alias_of"] else ""
        if r["variant_of"]:
            alias = f" (= {r['variant_of']}, inner={r['name'].split('+', 1)[1]})"
        print(
            f"{r['name']:<{w}} {'yes' if r['exact'] else 'no':<6} {r['input']:<12} "
            f"{'yes' if r['auto'] else '':<5} {r['options']:<8} {r['summary']}{alias}"
        )
    return 0


def add_parsers(sub: Any) -> None:
    """Register this family's commands on the ``sparcml`` subparsers."""
    demo = sub.add_parser(
        "demo",
        help="reduce gradient-like sparse vectors on local ranks with every algorithm",
        description="Spawns local ranks (gloo on loopback), reduces gradient-like sparse "
        "vectors with every algorithm and a dense allreduce, checks every result against the "
        "dense sum and prints time, bytes and speedup.",
    )
    add_bench_args(demo, repeats=5, size="4M")
    demo.set_defaults(run=lambda args: run_bench(args, "sparcml demo"))
    bench = sub.add_parser(
        "bench",
        help="sparse allreduce micro-benchmark with CSV/JSON output",
        description="Like demo, with repeated runs over fresh data and machine-readable output.",
    )
    add_bench_args(bench, repeats=10, size="16M")
    bench.add_argument("--json", help="write results (with config and machine) to this JSON file")
    bench.add_argument("--csv", help="write results to this CSV file")
    bench.add_argument(
        "--peers",
        action="store_true",
        help="also run PyTorch's fp16 and PowerSGD DDP hooks on the same vectors",
    )
    add_env_arg(bench)
    bench.set_defaults(run=lambda args: run_bench(args, "sparcml bench"))
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
    bp.set_defaults(run=bench_plot)
    _p = sub.add_parser("algorithms", help="list the registered sparse allreduce algorithms")
    _p.set_defaults(run=list_algorithms)
    bt = sub.add_parser(
        "bench-topk",
        help="Ok-Topk against TopkA, TopkDSA, gTopk, Gaussiank and dense allreduce",
        description="Local gloo ranks reduce Gaussian accumulators with every top-k sparse "
        "allreduce (paper 001) and a dense allreduce; prints time, bytes and checks.",
    )
    bt.add_argument("-P", "--world-size", type=positive_arg, default=4)
    bt.add_argument("-N", "--size", type=size_arg, default=size_arg("16M"))
    bt.add_argument("-d", "--density", type=fraction_arg, default=0.01)
    bt.add_argument("--repeats", type=positive_arg, default=5)
    bt.add_argument("--warmup", type=int, default=1)
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--timeout", type=float, default=300.0)
    bt.add_argument("--json", help="write the rows to this JSON file")
    add_env_arg(bt)
    bt.add_argument("-q", "--quiet", action="store_true")
    bt.set_defaults(run=bench_topk)
    bc = sub.add_parser(
        "bench-compress",
        help="throughput of every compression operator next to a plain copy",
        description="Times compress() of every operator and a clone of the same tensor in one "
        "run (4 MB and 64 MB float32 by default) and checks the throughput targets.",
    )
    bc.add_argument(
        "--sizes", type=positive_arg, nargs="+", default=[4, 64], help="tensor sizes in MB"
    )
    bc.add_argument("--repeats", type=positive_arg, default=7)
    bc.add_argument("--device", default="cpu", help="cpu or cuda")
    bc.add_argument("--threads", type=positive_arg, default=1, help="torch intra-op threads")
    bc.add_argument("--json", help="write the rows to this JSON file")
    bc.add_argument("-q", "--quiet", action="store_true")
    bc.set_defaults(run=bench_compress)
    bg = sub.add_parser(
        "bench-gpu",
        help="selection, quantizer and stream kernels on one device against their anchors",
        description="Times, in one run on one device: every selector against torch.topk at "
        "0.1% and 1% of a 64 MB gradient (RedSync's 16-38x claim), the quantizers as a "
        "share of a device-to-device copy (target 50%), and the sparse collectives' local "
        "stream kernels. Made for CUDA (benchmarks/gpu_check.sh); --device cpu runs it here.",
    )
    bg.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    bg.add_argument("--mb", type=positive_arg, default=64, help="gradient size in MB (float32)")
    bg.add_argument(
        "--densities",
        type=fraction_arg,
        nargs="+",
        default=[0.001, 0.01],
        help="selection densities",
    )
    bg.add_argument(
        "--stream-density", type=fraction_arg, default=0.01, help="density of the stream kernels"
    )
    bg.add_argument("--world", type=positive_arg, default=8, help="P of the stream kernels")
    bg.add_argument("--repeats", type=positive_arg, default=11)
    bg.add_argument("--json", help="write the rows to this JSON file")
    bg.add_argument("-q", "--quiet", action="store_true")
    bg.set_defaults(run=bench_gpu)
    bf = sub.add_parser(
        "bench-faults",
        help="kill / freeze a rank mid-collective: is the failed rank the one named?",
        description="Fault-injection runs over spawned gloo ranks. Kill and stop: P = 3 "
        "and 4 alternating, the victim cycling through every rank (0 included), killed "
        "(os._exit) or frozen (SIGSTOP) inside a collective of each algorithm, DDP training "
        "with each method, or DistributedOptimizer training; every survivor must raise the "
        "documented type (PeerFailedError for a kill, CommTimeoutError for a freeze) naming "
        "the victim. Mismatches: one rank passes one setting differently (algorithm, "
        "quantizer, quantize mode, index coding, k, dtype, N) or raises on its own, at each "
        "P of --mismatch-worlds: every rank must raise the documented error within 1 s. "
        "Prints every run and a summary table; exits 1 unless every run is right.",
    )
    bf.add_argument(
        "--runs",
        type=int,
        default=10,
        help="kill/stop runs per scenario and mode (0: mismatches only)",
    )
    bf.add_argument(
        "--scenarios",
        default="all",
        help="comma-separated: collective:ALGORITHM, ddp:METHOD, optimizer "
        "(default all: every algorithm, ddp:topk/oktopk/dense, optimizer)",
    )
    bf.add_argument("--modes", default="kill,stop")
    bf.add_argument("--timeout", type=float, default=3.0, help="communicator timeout, s")
    bf.add_argument(
        "--mismatch-worlds",
        default="2,3,4,5",
        help="world sizes of the mismatch matrix ('' to skip it)",
    )
    bf.add_argument("--json", help="write every run to this JSON file")
    bf.set_defaults(run=bench_faults)
    bl = sub.add_parser(
        "bench-local",
        help="local CPU work of the sparse collectives next to its memory-traffic bound",
        description="Times, in one process with one torch thread, each local kernel of the "
        "sparse collectives (ns per element) and the thread CPU time per rank per call of the "
        "sparse allreduce algorithms on P in-process ranks with uniform independent indices, "
        "each next to the time its bytes take at the measured copy bandwidth.",
    )
    bl.add_argument("-P", "--world-size", type=positive_arg, default=8)
    bl.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    bl.add_argument("-d", "--density", type=fraction_arg, default=0.00781)
    bl.add_argument("--reps", type=positive_arg, default=7, help="timed runs per kernel")
    bl.add_argument("--calls", type=positive_arg, default=3, help="timed calls per rank")
    bl.add_argument("--algorithms", default="ssar_split_allgather,ssar_recursive_double")
    bl.set_defaults(run=bench_local)
    bm = sub.add_parser(
        "bench-mpi",
        help="dense allreduce over MPICommunicator next to mpi4py's own Allreduce (mpirun)",
        description="Run under mpirun (mpirun -np 4 sparcml bench-mpi): times the dense "
        "allreduce of MPICommunicator, mpi4py's Allreduce into a preallocated buffer and "
        "into a fresh one, round robin, and prints the ratios.",
    )
    bm.add_argument(
        "-N", "--sizes", type=size_arg, nargs="+", default=[1 << 16, 1 << 20, 16 << 20],
        help="float32 elements per rank (default 64K 1M 16M)",
    )  # fmt: skip
    bm.add_argument("--repeats", type=positive_arg, default=10)
    bm.add_argument("--timeout", type=float, default=300.0)
    bm.add_argument("--json", help="write the rows to this JSON file")
    bm.set_defaults(run=bench_mpi)
