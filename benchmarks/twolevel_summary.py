"""Issue 31's comparison from ``sparcml bench --json`` runs on nodes: the fastest
two-level row against the fastest flat sparse row, flat dense gloo, the 16-bit
dense row and Horovod's two-level dense pattern, and ``auto`` against the fastest
row. Prints a Markdown table (nothing is written unless you redirect it).

"Flat" rows are neither ``two_level`` nor ``node_aware`` by the registry of the
code that runs this script: a ``node_aware`` row (TopkA, Gaussiank, gTopk) gathers
in two levels by itself on nodes, so it is listed in a column of its own (for a
file made before TopkA became node-aware, that column holds its flat run).

    python benchmarks/twolevel_summary.py docs/results/cluster/twolevel/final_2x4_run*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparcml.collectives.registry import algorithm_info, algorithms

BASELINES = ("dense", "dense_fp16", "dense_twolevel")


def summary_row(path: Path) -> dict[str, object]:
    doc = json.loads(path.read_text())
    rows = {r["algorithm"]: r for r in doc["rows"]}
    exact = set(algorithms(exact=True))
    sparse = {a: r["p50"] for a, r in rows.items() if a in exact and a != "dense"}
    two = {a: t for a, t in sparse.items() if algorithm_info(a).two_level}
    aware = {a: t for a, t in sparse.items() if algorithm_info(a).node_aware}
    flat = {a: t for a, t in sparse.items() if a not in two and a not in aware}
    best_two = min(two, key=two.__getitem__)
    best_flat = min(flat, key=flat.__getitem__) if flat else None
    best_aware = min(aware, key=aware.__getitem__) if aware else None
    fastest = min([*sparse.values(), *(rows[b]["p50"] for b in BASELINES if b in rows)])
    auto = rows.get("auto")
    t2 = two[best_two]
    return {
        "file": path.name,
        "P": doc["config"]["world_size"],
        "ranks_per_node": rows[best_two].get("ranks_per_node", "?"),
        "density": doc["config"]["density"],
        "two_level": f"{best_two} {t2 * 1e3:.2f} ms",
        "node_aware": f"{best_aware} {aware[best_aware] * 1e3:.2f} ms" if best_aware else "-",
        "flat": f"{best_flat} {flat[best_flat] * 1e3:.2f} ms" if best_flat else "-",
        "vs_flat": f"{flat[best_flat] / t2:.2f}x" if best_flat else "-",
        "vs_dense": f"{rows['dense']['p50'] / t2:.2f}x",
        "vs_fp16": f"{rows['dense_fp16']['p50'] / t2:.2f}x" if "dense_fp16" in rows else "-",
        "vs_dense_twolevel": (
            f"{rows['dense_twolevel']['p50'] / t2:.2f}x" if "dense_twolevel" in rows else "-"
        ),
        "auto": (
            f"{auto['chose']} {auto['p50'] * 1e3:.2f} ms, {auto['p50'] / fastest:.2f}x the fastest"
            if auto
            else "-"
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    cols = ["file", "P", "ranks_per_node", "density", "two_level", "node_aware", "flat", "vs_flat",
            "vs_dense", "vs_fp16", "vs_dense_twolevel", "auto"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for f in args.files:
        row = summary_row(f)
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
