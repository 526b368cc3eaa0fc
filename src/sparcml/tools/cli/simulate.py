"""The simulator: ``simulate``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import fraction_arg, positive_arg, size_arg

__all__ = ["add_parsers"]


def simulate(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    import torch

    from ...costmodel import CostModel
    from ..simulate import (
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
            try:
                rows = validate_against(
                    Path(f), model, args.quadratic_limit, args.compute, args.cores, args.repeats
                )
            except ValueError as e:
                print(f"sparcml simulate: {e}", file=sys.stderr)
                return 2
            for r in rows:
                r["file"] = f
                out.append(r)
                sim = "-" if r["simulated_s"] is None else f"{r['simulated_s'] * 1e3:,.1f}"
                err = "-" if r["error"] is None else f"{r['error']:+.0%}"
                print(
                    f"| {Path(f).name} | {r['P']} | {r['algorithm']} "
                    f"| {r['measured_s'] * 1e3:,.1f} | {sim} "
                    f"| {(r['model_s'] or 0) * 1e3:,.1f} | {err} |",
                    flush=True,
                )
        if args.json:
            from ..bench.harness import write_json

            write_json(args.json, "simulate-validate", out, {"files": args.validate})
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
        ranks_per_node=args.ranks_per_node,
        repeats=args.repeats,  # None: the compute mode's default (SimConfig.timed_calls)
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


def add_parsers(sub: Any) -> None:
    """Register this family's commands on the ``sparcml`` subparsers."""
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
        type=positive_arg,
        nargs="+",
        default=[4, 8, 16, 64, 256, 1024, 4096],
    )
    si.add_argument("-N", "--size", type=size_arg, default=size_arg("16M"))
    si.add_argument("-d", "--density", type=fraction_arg, default=0.00781)
    si.add_argument("--overlap", type=fraction_arg, default=0.0, help="share from a common hot set")
    si.add_argument("--algorithms", help="comma-separated (default: all simulated ones)")
    si.add_argument("--calibration", help="calibration JSON (default: the stored one)")
    si.add_argument(
        "--sim-elements",
        type=size_arg,
        default=size_arg("64M"),
        help="memory budget: scaled elements over all ranks (default 64M)",
    )
    si.add_argument("--quadratic-limit", type=positive_arg, default=1024,
                    help="largest P for P^2-work algorithms (model beyond)")  # fmt: skip
    si.add_argument(
        "--compute",
        choices=["model", "measured"],
        default="model",
        help="local work: gamma per element (model) or timed for real (measured)",
    )
    si.add_argument(
        "--cores",
        type=positive_arg,
        help="measured compute: cores the P ranks share on the predicted machine",
    )
    si.add_argument("--repeats", type=positive_arg,
                    help="timed calls per row, their median reported (default: 5 with "
                    "--compute measured, else 1: modelled compute repeats to the bit)")  # fmt: skip
    si.add_argument("--ranks-per-node", type=positive_arg, default=1,
                    help="ranks per node sharing one NIC (default 1: flat); messages inside "
                    "a node cost the calibration's alpha_intra/beta_intra")  # fmt: skip
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--out", help="write simulate.md/.json/.png into this directory")
    si.add_argument("--validate", nargs="+", metavar="BENCH_JSON",
                    help="simulate these measured bench runs and report the error")  # fmt: skip
    si.add_argument("--json", help="with --validate: write the comparison here")
    si.add_argument("-q", "--quiet", action="store_true")
    si.set_defaults(run=simulate)
