"""What ``auto`` would run on each simulated world, next to the simulated times.

Issue 31: ``auto`` chooses the two-level algorithm *and* the flat algorithm
between nodes (the variants ``twolevel_shard+ssar_split_allgather``, ...). This
reads a ``sparcml simulate --out`` result on nodes and prints, for each world of
several nodes: the model's choice among ``auto``'s candidates with the calibration
the simulation used, and with the default model (what a user without a
calibration file starts from); the candidates ``auto`` measures with the default
model (one inner per two-level algorithm, those within ``PRUNE_FACTOR`` of the
best prediction) and the simulated fastest of them, which measuring would pick;
the fastest simulated row and the dense row. Nothing is written unless you
redirect it.

    python benchmarks/auto_inner_choice.py docs/results/cluster/twolevel/sim_inner/simulate.json \
        --calibration docs/results/cluster/twolevel/calibration_2x4_1gbit.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sparcml.collectives.autotune import choose, measured_candidates
from sparcml.collectives.registry import algorithms
from sparcml.costmodel import CostModel


def ms(rows: dict[str, dict[str, Any]], name: str) -> str:
    return f"`{name}` {rows[name]['time_s'] * 1e3:,.2f} ms" if name in rows else f"`{name}` (-)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("simulation", type=Path, help="simulate.json of a run with --ranks-per-node")
    ap.add_argument("--calibration", type=Path, required=True, help="the run's calibration")
    args = ap.parse_args()
    doc = json.loads(args.simulation.read_text())
    by_p: dict[int, dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        by_p.setdefault(r["P"], {})[r["algorithm"]] = r
    calibrated, default = CostModel.load(args.calibration), CostModel()
    names = algorithms(auto=True)
    print("| nodes x ranks | auto, calibrated model | auto, default model | measured "
          "(default model's candidates) | fastest simulated | dense |")  # fmt: skip
    print("|---|---|---|---|---|---:|")
    for p, rows in sorted(by_p.items()):
        first = next(iter(rows.values()))
        n, per, d = first["N"], first["ranks_per_node"], first["density"]
        if p // per < 2:
            continue  # one node: auto runs the flat algorithms there
        ks = [round(d * n)] * p
        picks = [choose(m.for_topology(per), p, n, ks, 4, names) for m in (calibrated, default)]
        cands, _ = measured_candidates(default.for_topology(per), p, n, ks, 4, names)
        timed = [a for a in cands if a in rows]
        won = min(timed, key=lambda a: rows[a]["time_s"]) if timed else None
        measured = f"{', '.join(cands)}: {ms(rows, won) if won else '-'}"
        best = min(rows, key=lambda a: rows[a]["time_s"])
        print(f"| {p // per} x {per} | {ms(rows, picks[0])} | {ms(rows, picks[1])} | {measured} "
              f"| {ms(rows, best)} | {ms(rows, 'dense')} |")  # fmt: skip


if __name__ == "__main__":
    main()
