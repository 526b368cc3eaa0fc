"""Does the emulated cluster's shaping hold, and how close does gloo come to it?

Runs one 1 MiB gloo allreduce per rank inside ``sparcml cluster`` (after a warm
one) and prints each rank's time over the link bound ``2 (P-1)/P * bytes / rate``
of a ring allreduce: at least 0.9 means the shaping holds (nothing runs faster
than the link), near 1 that gloo fills the link. A measured time, so a benchmark
and not a test (the suite checks only that ranks connect and tear down).

    sudo .venv/bin/python benchmarks/cluster_link.py -P 3 --rate 20mbit
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

from sparcml.tools.cli import main

JOB = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    rate = float(sys.argv[1])
    dist.init_process_group("gloo")
    p = dist.get_world_size()
    x = torch.ones(1 << 18)  # 1 MiB
    dist.all_reduce(x)
    t = time.perf_counter()
    dist.all_reduce(x)
    dt = time.perf_counter() - t
    bound = 2 * (p - 1) / p * x.numel() * 4 * 8 / rate
    print(f"rank {dist.get_rank()}: {dt * 1e3:.1f} ms, link bound {bound * 1e3:.1f} ms, "
          f"ratio {dt / bound:.3f}")
    dist.destroy_process_group()
    """
)

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def main_(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-P", type=int, default=3)
    ap.add_argument("--rate", default="20mbit", help="tc rate, e.g. 20mbit or 1gbit")
    args = ap.parse_args(argv)
    unit = next((u for u in _UNITS if args.rate.endswith(u)), None)
    if unit is None:
        ap.error(f"--rate must end in one of {sorted(_UNITS)}, got {args.rate!r}")
    rate = float(args.rate[: -len(unit)]) * _UNITS[unit]
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        return main(["cluster", "-P", str(args.P), "--rate", args.rate, "--timeout", "120",
                     "--", sys.executable, str(job), str(rate)])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main_())
