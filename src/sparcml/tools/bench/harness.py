"""One benchmark harness and one report writer, for every ``sparcml`` benchmark.

In the style of nccl-tests: a :class:`Case` is what to run (one call of a
collective, made by every rank), how to check its last result, and the
tolerance; :func:`time_case` does the warm-up, a barrier before each timed
call, the timing (the slowest rank's time per call, as a collective's time is),
the bytes this rank sent per call, and the check. :func:`percentiles` gives the
p25/p50/p75 every table prints.

Every result file goes through :func:`write_json` / :func:`write_csv`, which
record the machine (host, CPUs, platform), the date, the versions (Python,
torch, sparcml, numpy) and the command that produced it next to the figures.
Tools never write into the repository unless told where.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...comm import Communicator

__all__ = [
    "STEAL_FLAG",
    "Case",
    "Timing",
    "cpu_times",
    "machine_info",
    "percentiles",
    "steal_share",
    "time_case",
    "write_csv",
    "write_json",
]


@dataclasses.dataclass
class Case:
    """One benchmarked operation.

    Attributes:
        name: the row's name.
        run: one call (a collective: every rank calls it); returns the result.
        check: ``check(result) -> (error, ok)`` for the last result (None: unchecked).
        tolerance: the error ``check`` accepts, for the report (None: not bounded).
    """

    name: str
    run: Callable[[], Any]
    check: Callable[[Any], tuple[float, bool]] | None = None
    tolerance: float | None = None


@dataclasses.dataclass
class Timing:
    """What :func:`time_case` measured for one case."""

    name: str
    times: list[float]  # seconds per timed call: the slowest rank's
    sent: list[int]  # bytes this rank sent per timed call
    result: Any
    error: float = math.nan
    ok: bool | None = None
    cpu: list[float] = dataclasses.field(default_factory=list)  # the busiest rank's CPU s

    @property
    def p25(self) -> float:
        return percentiles(self.times)[0]

    @property
    def p50(self) -> float:
        return percentiles(self.times)[1]

    @property
    def p75(self) -> float:
        return percentiles(self.times)[2]


def percentiles(times: Sequence[float]) -> tuple[float, float, float]:
    """``(p25, p50, p75)`` of the timed calls (all three the value if there is one)."""
    if not times:
        return (math.nan, math.nan, math.nan)
    if len(times) == 1:
        return (times[0], times[0], times[0])
    q = statistics.quantiles(times, n=4)
    return (q[0], statistics.median(times), q[2])


def time_case(
    comm: Communicator, case: Case, warmup: int = 1, repeats: int = 5, barrier: bool = True
) -> Timing:
    """Warm up, then time ``repeats`` calls of ``case.run`` (a collective on ``comm``).

    Each timed call starts after a barrier; its time is the slowest rank's (one
    small max-allreduce after the call, outside the timing), so every rank gets
    the same figures; so is its local CPU time (the process's CPU seconds during
    the call, every thread of it: with one process per rank, the rank's local
    work). The last result is checked with ``case.check``.
    """
    for _ in range(warmup):
        case.run()
    times: list[float] = []
    cpu: list[float] = []
    sent: list[int] = []
    result: Any = None
    for _ in range(repeats):
        if barrier:
            comm.barrier()
        before = comm.stats.bytes_sent
        c = time.process_time()
        t = time.perf_counter()
        result = case.run()
        elapsed = time.perf_counter() - t
        used = time.process_time() - c
        sent.append(comm.stats.bytes_sent - before)
        worst = comm.allreduce(torch.tensor([elapsed, used], dtype=torch.float64), op="max")
        times.append(float(worst[0]))
        cpu.append(float(worst[1]))
    timing = Timing(case.name, times, sent, result, cpu=cpu)
    if case.check is not None:
        timing.error, timing.ok = case.check(result)
    return timing


def cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """The machine's CPU time stolen by its host and its CPU time in all, in clock ticks
    since boot: ``/proc/stat``'s ``cpu`` line (steal is time the hypervisor gave this
    machine's CPUs to other work while they had work of their own; the load average
    does not count it). None where there is no such file (not Linux)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is within user)
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


#: a run whose host took more than this share of the machine's CPU time is flagged:
#: its times are the contended host's, not the machine's (on the 2-core development
#: VM, a quiet job's steal was 0.2% and a contended one's 2.3%, with plain DDP's step
#: at 13.9 against 15.2 ms)
STEAL_FLAG = 0.01


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time its host stole between two :func:`cpu_times`
    readings (None without both, or without time between them)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def machine_info(transport: str | None = None) -> dict[str, Any]:
    """The machine, date and software versions a figure was measured with."""
    from ... import __version__

    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "sparcml": __version__,
        },
    }
    try:
        import numpy

        info["versions"]["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if transport:
        info["transport"] = transport
    return info


def _command() -> str:
    return shlex.join(["sparcml", *sys.argv[1:]]) if sys.argv else "sparcml"


def write_json(
    path: str | os.PathLike[str],
    kind: str,
    rows: Any,
    config: dict[str, Any] | None = None,
    *,
    transport: str | None = None,
    command: str | None = None,
    **extra: Any,
) -> Path:
    """Write a result document: what, the rows, the configuration, the machine, the command.

    Args:
        path: the file (its directory is created).
        kind: which tool made it (``"bench"``, ``"bench-topk"``, ``"simulate"``, ...).
        rows: the figures (JSON-serialisable).
        config: the run's configuration.
        transport: how ranks talked (recorded with the machine).
        command: the command line (default: this process's ``sparcml ...`` argv).
        **extra: more top-level keys.
    """
    doc = {
        "kind": kind,
        "command": command if command is not None else _command(),
        "machine": machine_info(transport),
        "config": config or {},
        **extra,
        "rows": rows,
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return p


def write_csv(
    path: str | os.PathLike[str],
    rows: Sequence[dict[str, Any]],
    fixed: dict[str, Any] | None = None,
) -> Path:
    """Write rows as CSV, each prefixed by the ``fixed`` columns (e.g. P, N, density).

    A ``# `` comment line first records the command and the machine.
    """
    fixed = fixed or {}
    fields: list[str] = list(fixed)
    for r in rows:
        fields += [k for k in r if k not in fields]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    m = machine_info()
    with open(p, "w", newline="") as f:
        f.write(f"# {_command()} | {m['host']} {m['platform']} | {m['date']}\n")
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**fixed, **r})
    return p
