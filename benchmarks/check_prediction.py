"""How well ``sparcml train --predict`` foresees another link: each method's time per
step predicted from a run at one rate, next to the run measured at the other.

Given two ``results.json`` of the same recipe and methods (``--cluster`` runs at two
link rates), prints per method the measured ms per step at each rate, the
prediction of each from the other run, and the ratio predicted / measured.

    .venv/bin/python benchmarks/check_prediction.py RUN_A/results.json RUN_B/results.json
"""

from __future__ import annotations

import argparse
import os

from sparcml.tools.recipes.tta import load_result, parse_rate, predict_ms, tta_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    results = [load_result(p) for p in (args.a, args.b)]
    rates = [r["link_rate"] for r in results]
    rows = [{r["method"]: r for r in tta_rows(res, parse_rate(rate))}
            for res, rate in zip(results, rates, strict=True)]  # fmt: skip
    print(f"{results[0]['recipe']}, P = {results[0]['world']}: {rates[0]} and {rates[1]}; "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"| method | measured @ {rates[0]} | predicted from {rates[1]} | ratio "
          f"| measured @ {rates[1]} | predicted from {rates[0]} | ratio |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for method in rows[0]:
        if method not in rows[1]:
            continue
        cells = []
        for here, there in ((0, 1), (1, 0)):
            measured = rows[here][method]["ms_per_step"]
            pred = predict_ms(rows[there][method], parse_rate(rates[here]))
            ratio = pred / measured if pred is not None else None
            if ratio is not None:
                worst = max(worst, abs(ratio - 1))
            cells += [f"{measured:.1f}", "-" if pred is None else f"{pred:.1f}",
                      "-" if ratio is None else f"{ratio:.2f}"]  # fmt: skip
        print(f"| {method} | " + " | ".join(cells) + " |")
    print(f"largest error: {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
