r"""The split allgather's own steps at P = 2, each alone on one core (no transport).

Issue 35, item 1: what one ``ssar_split_allgather`` call at P = 2 computes besides
its two transfers (paper 000, sec. 5.3.2), for two ranks' uniform random streams
of ``k = d N`` entries, timed one step at a time in this process (p50 of
``--repeats``, after one untimed call), with the library's allocator settings
(:func:`sparcml.comm.keep_freed_memory`, as its launchers set them):

* step 1: split this rank's stream into the two ranges, encode the peer's piece,
  decode the piece received;
* step 2: sum the two pieces of this rank's range;
* step 3: encode the reduced range; decode the gathered ranges into the result
  (this rank's own copied in, the other's decoded).

    .venv/bin/python benchmarks/split_local_work.py -N 16M -d 0.00781
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from sparcml import SparseStream
from sparcml.collectives._common import decode_or_empty, encode_or_empty, partition_boundaries
from sparcml.collectives.codec import StreamCodec
from sparcml.comm import keep_freed_memory
from sparcml.compress.selection import k_of
from sparcml.tools.cli.common import size_arg


def p50_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=16 << 20)
    ap.add_argument("-d", "--density", type=float, default=0.00781)
    ap.add_argument("--repeats", type=int, default=51)
    args = ap.parse_args()
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    n, k = args.size, k_of(args.density, args.size)
    cpu = torch.device("cpu")

    def stream(seed: int) -> SparseStream:
        g = torch.Generator().manual_seed(seed)
        return SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)

    mine, theirs = stream(0), stream(1)
    codec = StreamCodec(index_coding="auto")
    bounds = partition_boundaries(n, 2)
    width = bounds[1] - bounds[0]
    pieces, their_pieces = mine.split(bounds), theirs.split(bounds)
    piece_msg = encode_or_empty(their_pieces[0], codec)
    reduced = SparseStream.sum([pieces[0], their_pieces[0]])
    range_msg = codec.encode(reduced, partial=True)
    gathered = [range_msg, codec.encode(SparseStream.sum([pieces[1], their_pieces[1]]))]
    own = {0: codec.roundtrip(reduced, range_msg, partial=True)}
    steps = {
        "1 split this rank's stream into 2 ranges": lambda: mine.split(bounds),
        f"1 encode the peer's piece ({pieces[1].nnz:,} entries)": lambda: encode_or_empty(
            pieces[1], codec
        ),
        f"1 decode the piece received ({their_pieces[0].nnz:,})": lambda: decode_or_empty(
            piece_msg, width, torch.float32, cpu, codec
        ),
        "2 sum the two pieces of this rank's range": lambda: SparseStream.sum(
            [pieces[0], their_pieces[0]]
        ),
        f"3 encode the reduced range ({reduced.nnz:,})": lambda: codec.encode(
            reduced, partial=True
        ),
        "3 decode the gathered ranges (own copied)": lambda: codec.decode_concat(
            gathered, [width, n - width], torch.float32, cpu, own
        ),
    }
    print(f"N={n:,} k={k:,} per rank, P = 2, one core, freed memory kept: {kept}; "
          f"p50 of {args.repeats}")  # fmt: skip
    total = 0.0
    for name, fn in steps.items():
        ms = p50_ms(fn, args.repeats)
        total += ms
        print(f"  {name:<48} {ms:6.3f} ms")
    print(f"  {'all of them':<48} {total:6.3f} ms")
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
