"""Bytes per index and coding time: fixed fields, LEB128 varints of the gaps, Elias--Fano.

Issue 35, item 2: fewer bytes per index for exact streams. For uniform random
indices at the given densities (the papers' setting), this prints

* per message of ``k = d N`` indices below ``N``: the bytes per index of sec. 5.1's
  ``c``-byte fields, of varint-coded gaps (:func:`sparcml.compress.packing.encode_index_deltas`)
  and of the Elias--Fano field (:mod:`sparcml.indexcode`), and the time to encode
  and to decode (with the checks) a whole message each way on one thread (median of
  ``--repeats``), next to the time its saved bytes take on a link of ``--rate``;
* the bytes every rank sends in one ``sparse_allreduce`` on ``--world`` in-process
  ranks (``ssar_recursive_double`` and ``ssar_split_allgather``), with
  ``index_coding="fixed"`` (before) and the default ``"auto"`` (after).

    .venv/bin/python benchmarks/index_bytes.py -N 16M -d 0.001,0.00781,0.05 -P 8

Times depend on the machine: run it on a quiet one (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.compress.packing import decode_index_deltas, encode_index_deltas
from sparcml.tools.bench.local import median_seconds
from sparcml.tools.cli.common import size_arg
from sparcml.wire import decode, encode


def _message_rows(n: int, densities: list[float], repeats: int, rate: float) -> None:
    print(f"one message of k = d N uniform random indices below N = {n:,} (float32 values)")
    print(
        f"{'density':>8} {'k':>9} | {'bytes/index':^26} | {'encode ms':^17} | "
        f"{'decode ms':^17} | {'saved on link':>13}"
    )
    print(
        f"{'':>8} {'':>9} | {'fixed':>8} {'varint':>8} {'E-F':>8} | {'fixed':>8} {'E-F':>8} | "
        f"{'fixed':>8} {'E-F':>8} | {'ms':>13}"
    )
    g = torch.Generator().manual_seed(0)
    for d in densities:
        k = max(1, round(d * n))
        idx = torch.randperm(n, generator=g)[:k].sort().values
        s = SparseStream.from_sorted(idx, torch.randn(k, generator=g), n)
        fixed, coded = encode(s, elias_fano=False), encode(s)
        varint = encode_index_deltas(idx).numel()
        assert torch.equal(decode_index_deltas(encode_index_deltas(idx), k)[0], idx)
        vbytes = 4 * k + 24
        per = [(fixed.numel() - vbytes) / k, varint / k, (coded.numel() - vbytes) / k]
        enc = [
            1e3 * median_seconds(lambda s=s: encode(s, elias_fano=False), repeats),
            1e3 * median_seconds(lambda s=s: encode(s), repeats),
        ]
        dec = [
            1e3 * median_seconds(lambda b=fixed: decode(b), repeats),
            1e3 * median_seconds(lambda b=coded: decode(b), repeats),
        ]
        saved_ms = (fixed.numel() - coded.numel()) * 8 / rate * 1e3
        print(
            f"{d:>8.5f} {k:>9,} | {per[0]:>8.3f} {per[1]:>8.3f} {per[2]:>8.3f} | "
            f"{enc[0]:>8.3f} {enc[1]:>8.3f} | {dec[0]:>8.3f} {dec[1]:>8.3f} | {saved_ms:>13.3f}"
        )


def _rank_bytes(n: int, p: int, d: float, algorithm: str, coding: str) -> float:
    k = max(1, round(d * n))

    def job(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        s = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
        comm.stats.reset()
        sparse_allreduce(s, comm, algorithm, index_coding=coding)
        return comm.stats.bytes_sent

    return statistics.mean(run_ranks(p, job)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", type=size_arg, default=16 * 2**20, help="vector size (default 16M)")
    ap.add_argument("-d", "--densities", default="0.001,0.00781,0.05", help="comma-separated")
    ap.add_argument("-P", "--world", type=int, default=8, help="in-process ranks (default 8)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--rate", default="1gbit", help="the link the saved bytes are costed on")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rate = {"mbit": 1e6, "gbit": 1e9}[args.rate[-4:]] * float(args.rate[:-4])
    densities = [float(x) for x in args.densities.split(",")]
    print(
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}"
    )
    _message_rows(args.N, densities, args.repeats, rate)
    print()
    print(f"MB sent per rank by one sparse_allreduce, P = {args.world}, N = {args.N:,}")
    print(f"{'density':>8} {'algorithm':<24} {'fixed':>9} {'auto':>9} {'auto/fixed':>11}")
    for d in densities:
        for algorithm in ("ssar_recursive_double", "ssar_split_allgather"):
            before = _rank_bytes(args.N, args.world, d, algorithm, "fixed")
            after = _rank_bytes(args.N, args.world, d, algorithm, "auto")
            print(f"{d:>8.5f} {algorithm:<24} {before:>9.3f} {after:>9.3f} {after / before:>11.3f}")


if __name__ == "__main__":
    main()
