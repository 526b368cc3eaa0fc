"""How far the golden pipeline's parameters move on other CPU kernels.

``tests/test_golden_pipeline.py`` compares the final parameters by hash on the
kernels its table was written with and by a fingerprint (norm and three fixed
random projections) elsewhere, within ``FINGERPRINT_RTOL`` of the norm. This runs
the table's 111 cases on two local gloo ranks with whatever kernels the
environment selects and prints how many hashes and byte counts equal the table's
and the largest fingerprint offset, e.g. with ATen's portable kernels::

    ATEN_CPU_CAPABILITY=default .venv/bin/python benchmarks/golden_kernels.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import golden_workers  # noqa: E402  (tests/, on the path above)
from sparcml.comm.launch import run_processes  # noqa: E402


def main() -> None:
    table = json.loads((TESTS / "data" / "golden_pipeline.json").read_text())
    golden, meta = table["cases"], table["meta"]
    now = run_processes(2, golden_workers.golden_runs, timeout=300)[0]
    hashes = sum(now[k]["hash"] == g["hash"] for k, g in golden.items())
    nbytes = sum(now[k]["step_bytes"] == g["step_bytes"] for k, g in golden.items())
    worst, case = 0.0, ""
    for k, g in golden.items():
        off = max(abs(a - b) for a, b in zip(now[k]["fingerprint"], g["fingerprint"], strict=True))
        if off / abs(g["fingerprint"][0]) > worst:
            worst, case = off / abs(g["fingerprint"][0]), k
    kernels = torch.backends.cpu.get_cpu_capability()
    print(f"table: torch {meta['torch']}, {meta['cpu_capability']} kernels; "
          f"now: torch {torch.__version__}, {kernels} kernels")  # fmt: skip
    n = len(golden)
    print(f"hashes equal: {hashes} of {n}; bytes per step equal: {nbytes} of {n}")
    print(f"largest fingerprint offset: {worst:.3e} of the norm ({case})")


if __name__ == "__main__":
    main()
