"""What ``algorithm="auto"`` costs per call before any message: its plan.

Issue 30, item 2 (the lean step): every ``auto`` call of the DDP hook asks
:func:`sparcml.collectives.autotune.plan` what to run. It used to read the
calibration file's path (pathlib, twice) and predict every candidate's time
again on every call. This times ``plan`` alone for a settled class (the hook's
steady state: P = 2, a 650,000-entry bucket at 1%), without and with a
calibration file, on one thread, in rounds of calls; it prints the median
microseconds per call. Run it on two checkouts to compare
(``PYTHONPATH=OTHER/src``).

    .venv/bin/python benchmarks/auto_plan_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from sparcml import CostModel
from sparcml.collectives import autotune
from sparcml.comm.local import LocalCommunicator, LocalWorld


def per_call_us(calls: int, rounds: int) -> float:
    comm = LocalCommunicator(LocalWorld(2), 0)
    args = (comm, 650_000, [6_500, 6_500], 4, False, None, True)
    autotune.plan(*args)  # (the class is settled by the model: no measuring)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            autotune.plan(*args)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}")
    os.environ.pop("SPARCML_CALIBRATION", None)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HOME"] = tmp  # (no calibration file in the home directory)
        print(f"no calibration file: {per_call_us(args.calls, args.rounds):.1f} us per call")
        path = os.path.join(tmp, "cal.json")
        CostModel(alpha=6e-4, beta=8.7e-9, gamma=1.8e-8).save(path)
        os.environ["SPARCML_CALIBRATION"] = path
        print(f"a calibration file:  {per_call_us(args.calls, args.rounds):.1f} us per call")


if __name__ == "__main__":
    main()
