r"""One message's encode and decode, this checkout against another, in one process.

The library of ``--before`` (another checkout's ``src`` folder, e.g. a ``git
worktree`` of an earlier commit) is copied under the name ``sparcml_before`` and
imported next to this one, so both codecs run alternately, round by round, on the
same streams in the same process: the per-round ratio is free of the drift
between jobs that separate runs see on a shared machine. Per stream of ``k``
uniform random indices below ``N`` with float32 values, p50 microseconds of
``--calls`` calls per round:

* ``exact encode`` / ``exact decode``: :func:`sparcml.wire.encode` /
  :func:`~sparcml.wire.decode` (Elias--Fano indices where smaller: the CPU's
  ``index_coding="auto"``);
* ``natural encode`` / ``natural decode``: the quantized message of
  ``topk+natural`` (:func:`~sparcml.compress.base.encode_quantized_stream` with
  ``index_coding="elias-fano"``, 9-bit natural compression).

    git worktree add /tmp/before 42a2376
    .venv/bin/python benchmarks/codec_ab.py --before /tmp/before/src -k 4400,50000
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType

import torch

import sparcml
from sparcml.tools.cli.common import size_arg


def load_before(src: str) -> ModuleType:
    """The library of ``src`` imported as ``sparcml_before`` (its imports are relative;
    the one absolute import, its compiled kernels', is pointed at the copy)."""
    where = tempfile.mkdtemp(prefix="codec_ab_")
    atexit.register(shutil.rmtree, where, True)  # (the copy goes when this process ends)
    copy = os.path.join(where, "sparcml_before")
    shutil.copytree(os.path.join(src, "sparcml"), copy)
    # libraries up to 2f5c076 import their compiled kernels by the absolute name
    # sparcml.cpu_kernels, which would load this checkout's: the copy gets its own
    kernels = os.path.join(copy, "kernels.py")
    with open(kernels) as f:
        text = f.read()
    with open(kernels, "w") as f:
        f.write(text.replace("sparcml.cpu_kernels", "sparcml_before.cpu_kernels"))
    sys.path.insert(0, where)
    return importlib.import_module("sparcml_before")


def start_ab(src: str) -> tuple[ModuleType, str]:
    """An A/B process's start: one thread, freed memory kept for reuse, the library of
    ``src`` loaded (:func:`load_before`); returns it and the load average, as text."""
    torch.set_num_threads(1)
    sparcml.comm.keep_freed_memory()
    before = load_before(src)
    return before, " ".join(f"{x:.2f}" for x in os.getloadavg())


def _calls(lib: ModuleType, n: int, k: int) -> dict[str, Callable[[], object]]:
    base = importlib.import_module(lib.__name__ + ".compress.base")
    wire = importlib.import_module(lib.__name__ + ".wire")
    natural = importlib.import_module(lib.__name__ + ".compress").get("natural")
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    stream = lib.SparseStream.from_sorted(idx, torch.randn(k, generator=g), n)
    gen = torch.Generator().manual_seed(1)
    quantized = base.encode_quantized_stream(stream, natural, gen, "elias-fano")
    exact = wire.encode(stream)
    cpu = torch.device("cpu")
    return {
        "exact encode": lambda: wire.encode(stream),
        "exact decode": lambda: wire.decode(exact),
        "natural encode": lambda: base.encode_quantized_stream(stream, natural, gen, "elias-fano"),
        "natural decode": lambda: base.decode_quantized_stream(
            quantized, natural, torch.float32, cpu
        ),
    }


def ratio_text(before: list[float], after: list[float]) -> str:
    """The median of the per-round ratios before / after, and their range."""
    ratios = [x / y for x, y in zip(before, after, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}x-{max(ratios):.2f}x)"


def _p50(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="another checkout's src folder")
    ap.add_argument("-N", "--size", type=size_arg, default=1 << 20)
    ap.add_argument("-k", "--nnz", default="4400,50000", help="indices, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=51)
    args = ap.parse_args()
    before, load = start_ab(args.before)
    print(f"N={args.size:,}, one thread, {args.rounds} rounds of {args.calls} calls, "
          f"alternated; load average {load}")  # fmt: skip
    print(f"{'k':>7} {'message':<15} {'before us':>10} {'after us':>9} "
          f"{'before/after (per round: median, range)':>40}")  # fmt: skip
    for k in (int(x) for x in args.nnz.split(",")):
        old, new = _calls(before, args.size, k), _calls(sparcml, args.size, k)
        got: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in old}
        for _ in range(args.rounds):
            for name in old:
                got[name][0].append(_p50(old[name], args.calls))
                got[name][1].append(_p50(new[name], args.calls))
        for name, (a, b) in got.items():
            print(f"{k:>7,} {name:<15} {statistics.median(a):>10.1f} {statistics.median(b):>9.1f} "
                  f"{ratio_text(a, b):>40}")  # fmt: skip
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
