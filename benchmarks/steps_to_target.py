"""Steps to the target per run: which momentum arrangement trains in fewer steps.

Reads the ``results.json`` of ``sparcml train`` runs (local ranks or ``--cluster``;
the number of steps does not depend on the link, so loopback runs answer it) and
prints, per run directory, the final test figure and the steps at the first
evaluation within dense's final (1 point of accuracy, 3% of perplexity). The
dense run is the one whose directory is given with ``--dense``; every other
directory is compared with it.

    .venv/bin/python benchmarks/steps_to_target.py --dense DIR_DDP DIR_A DIR_B ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparcml.tools.recipes.train import within_target
from sparcml.tools.recipes.tta import steps_to


def _runs(path: Path) -> tuple[dict, dict]:
    doc = json.loads((path / "results.json").read_text())
    runs = doc["rows"] if isinstance(doc["rows"], dict) else doc["runs"]
    return doc, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", required=True, type=Path, help="the dense run's directory")
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    doc, runs = _runs(args.dense)
    metric, higher = doc["metric"], doc["higher_is_better"]
    base = runs.get("ddp") or runs["dense"]
    final = float(base["evals"][-1][metric])
    target = within_target(final, higher)
    n_dense = steps_to(base, metric, target, higher)
    print(f"{doc['recipe']}: dense final {metric} {final:.4f}, target {target:.4f}, "
          f"dense reaches it at step {n_dense} of {len(base['losses'])}")  # fmt: skip
    print(f"| run | method | final {metric} | steps to within | vs dense |")
    print("|---|---|---:|---:|---:|")
    for path in args.runs:
        _, r = _runs(path)
        for method, run in r.items():
            n = steps_to(run, metric, target, higher)
            ratio = f"{n / n_dense:.2f}x" if n and n_dense else "-"
            print(f"| {path.name} | {method} | {float(run['evals'][-1][metric]):.4f} "
                  f"| {'never' if n is None else n} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
