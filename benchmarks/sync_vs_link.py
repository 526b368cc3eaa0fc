r"""Issue 30's lean-step measure from time-to-accuracy reports: each method's sync per
step next to its link bound (bytes / rate, headers counted, + messages x alpha) and
their ratio (the target: top-k methods within 1.5x).

    python benchmarks/sync_vs_link.py --rate 100mbit RESULTS.json [RESULTS.json ...]

Reads the ``results.json`` of ``sparcml train ... --cluster`` (or ``--env``) runs and
prints one line per method and file, from :func:`sparcml.tools.recipes.tta.tta_rows`.
Runs that also hold the compute figure the harness reported before the slowest
rank's (``compute_rank_median_s``: each rank's median pass, mean over the ranks)
get the sync and ratio under that figure too (the ``median`` columns).
"""

from __future__ import annotations

import argparse
from typing import Any

from sparcml.tools.recipes.tta import ALPHA_S, load_result, parse_rate, tta_rows


def _rank_median_sync_ms(run: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The row's sync with the rank-median compute figure, where the run has it."""
    median_s = run.get("compute_rank_median_s")
    if median_s is None or row["compute_ms"] is None or row["sync_ms"] is None:
        return None
    return max(0.0, row["ms_per_step"] - 1000 * median_s - row["optimizer_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", required=True, help="the runs' link rate (tc syntax: 100mbit)")
    ap.add_argument("results", nargs="+", help="results.json files")
    args = ap.parse_args()
    rate = parse_rate(args.rate)
    print(f"link {args.rate}; alpha {ALPHA_S * 1e6:.0f} us a message")
    print(f"{'method':<14} {'ms/step':>8} {'compute':>8} {'sync':>7} {'link':>7} "
          f"{'sync/link':>9} {'median sync':>11} {'median sync/link':>16}  file")  # fmt: skip
    for path in args.results:
        result = load_result(path)
        for row in tta_rows(result, rate):
            bound = row["wire_ms"] + 1000 * ALPHA_S * (row.get("messages_per_step") or 0.0)
            sync = row["sync_ms"]
            ratio = f"{sync / bound:.2f}x" if sync is not None and bound else "-"
            old = _rank_median_sync_ms(result["runs"][row["method"]], row)
            old_s = "-" if old is None else f"{old:.2f}"
            old_ratio = f"{old / bound:.2f}x" if old is not None and bound else "-"
            print(f"{row['method']:<14} {row['ms_per_step']:8.2f} {row['compute_ms'] or 0:8.2f} "
                  f"{sync if sync is not None else float('nan'):7.2f} {bound:7.2f} {ratio:>9} "
                  f"{old_s:>11} {old_ratio:>16}  {path}")  # fmt: skip


if __name__ == "__main__":
    main()
