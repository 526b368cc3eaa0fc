"""Issue 35's table from ``sparcml bench --json`` runs: the fastest exact sparse row
against dense fp32 gloo and the 16-bit dense row, ``auto`` against the fastest row,
and each exact sparse row's time against its wire bound (the bytes the busiest rank
sends, at the link's rate). Prints a Markdown table (nothing is written unless you
redirect it).

    python benchmarks/floor_summary.py --rate 1gbit docs/results/cluster/indexcode/bench_P8_*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparcml.collectives.registry import algorithms

RATES = {"mbit": 1e6, "gbit": 1e9}


def rate_arg(text: str) -> float:
    """``100mbit`` / ``1gbit`` as bits per second."""
    for unit, scale in RATES.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise argparse.ArgumentTypeError(f"a rate such as 1gbit or 100mbit, got {text!r}")


def summary(path: Path, rate: float) -> tuple[dict[str, str], list[str]]:
    """The run's comparison row, and one line per exact sparse row against its wire bound."""
    doc = json.loads(path.read_text())
    rows = {r["algorithm"]: r for r in doc["rows"]}
    exact = set(algorithms(exact=True)) - {"dense"}
    sparse = {a: r for a, r in rows.items() if a in exact}
    best = min(sparse, key=lambda a: sparse[a]["p50"])
    t = sparse[best]["p50"]
    fastest = min(r["p50"] for a, r in rows.items() if a != "auto")
    auto = rows.get("auto")
    row = {
        "file": path.name,
        "P": str(doc["config"]["world_size"]),
        "density": str(doc["config"]["density"]),
        "dense": f"{rows['dense']['p50'] * 1e3:.2f} ms",
        "fp16": f"{rows['dense_fp16']['p50'] * 1e3:.2f} ms",
        "fastest exact": f"{best} {t * 1e3:.2f} ms",
        "vs dense": f"{rows['dense']['p50'] / t:.2f}x",
        "vs fp16": f"{rows['dense_fp16']['p50'] / t:.2f}x",
        "auto": (
            f"{auto['chose']} {auto['p50'] * 1e3:.2f} ms, {auto['p50'] / fastest:.2f}x the fastest"
            if auto
            else "-"
        ),
    }
    bounds = []
    for a in sorted(sparse, key=lambda a: sparse[a]["p50"]):
        r = sparse[a]
        wire = r["bytes_sent_max"] * 8 / rate
        bounds.append(
            f"{path.name}: {a} {r['p50'] * 1e3:.2f} ms, {r['bytes_sent_max'] / 1e6:.3f} MB from "
            f"the busiest rank, wire bound {wire * 1e3:.2f} ms, {r['p50'] / wire:.2f}x the bound"
        )
    return row, bounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--rate", type=rate_arg, default=1e9, help="the link (default 1gbit)")
    args = ap.parse_args()
    out = [summary(f, args.rate) for f in args.files]
    cols = list(out[0][0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row, _ in out:
        print("| " + " | ".join(row[c] for c in cols) + " |")
    print()
    for _, bounds in out:
        for line in bounds:
            print(line)


if __name__ == "__main__":
    main()
