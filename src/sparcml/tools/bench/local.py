"""``sparcml bench-local``: the local work of the sparse collectives next to its memory bound.

Two tables, measured in one process with one torch thread:

* kernels: ns per element of each step a sparse collective runs locally (the
  merge-sum of the ``P`` sorted pieces of one range, the two-way merge of
  recursive doubling, encode, decode, the final concatenation), and the time
  the bytes that step must read and write take at this machine's measured
  copy bandwidth (``bound``);
* collectives: thread CPU time per rank per call of ``ssar_split_allgather``
  and ``ssar_recursive_double`` on ``P`` in-process ranks
  (:func:`sparcml.comm.run_ranks`), uniform independent indices on every rank
  (the papers' setting), next to the memory-traffic bound of the bytes one
  rank must touch: its own pairs, the messages it writes and reads, the
  partial sums and the result (``rank_bound_bytes``). Measured twice: with the
  ranks running together (``shared``: ``P`` threads on this machine's cores,
  so cache, GIL and scheduler contention inflate every rank's CPU time) and
  with the ranks taking turns (``alone``: ``run_ranks(take_turns=True)``, one
  rank computes at a time, as each would on a core of its own in a cluster).

Timings are medians over ``reps`` calls (per rank, then the median and the
maximum over ranks); the machine's other load shows in the spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ...collectives import sparse_allreduce
from ...comm import Communicator, run_ranks
from ...compress.natural import NaturalCompression
from ...compress.selection import k_of
from ...compress.topk import TopK
from ...finite import all_finite
from ...indexcode import index_field_nbytes
from ...reinterpret import index_low_bytes
from ...stream import SparseStream
from ...wire import decode, decode_concat, encode, widen_increasing

__all__ = [
    "collective_rows",
    "copy_bandwidth",
    "kernel_rows",
    "median_seconds",
    "uniform_stream",
]


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """The median wall seconds of ``reps`` calls of ``fn`` after one untimed call."""
    fn()  # warm-up (compiles kernels on first use)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted), the memory bound's unit."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), reps)


def uniform_stream(
    size: int, nnz: int, seed: int, device: str | torch.device = "cpu"
) -> SparseStream:
    """``nnz`` uniform random distinct positions in ``[0, size)`` with normal values
    (drawn on the CPU, then moved to ``device``: the same stream on every device)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(size, generator=g)[:nnz].sort().values
    return SparseStream.from_sorted(idx, torch.randn(nnz, generator=g), size).to(device)


Case = tuple[str, int, int, Callable[[], Any]]


def stream_cases(n: int, p: int, density: float, device: str | torch.device = "cpu") -> list[Case]:
    """The sparse collectives' local stream kernels on uniform random indices (the
    papers' setting) at ``density`` of ``n`` entries split into ``p`` ranges:
    ``(name, elements, bytes read and written, call)`` for the merge-sum of ``p``
    pieces of a range, recursive doubling's last two-way merge, encode and decode of
    ``p`` reduced ranges, their concatenation, and decoding straight into the result.
    ``sparcml bench-local`` (CPU) and ``sparcml bench-gpu`` time the same cases."""
    k = k_of(density, n)
    width = n // p
    isize = 4
    pair = 8 + isize  # an in-memory pair: int64 index, float32 value
    pieces = [uniform_stream(width, max(k // p, 1), 100 + r, device) for r in range(p)]
    reduced = SparseStream.sum(pieces)
    half = max(int(n * (1 - (1 - density) ** (p // 2))), 1)
    a, b = uniform_stream(n, half, 1, device), uniform_stream(n, half, 2, device)
    union = a + b
    parts = [uniform_stream(width, reduced.nnz, 200 + r, device) for r in range(p)]
    bufs = [encode(x) for x in parts]
    wire = sum(b.numel() for b in bufs)  # the messages as sent (the smaller index fields)
    decoded = [decode(x) for x in bufs]
    result = SparseStream.concat(decoded)
    return [
        (
            f"merge-sum of {p} sorted pieces of one range",
            k,
            k * pair + reduced.nnz * pair,
            lambda: SparseStream.sum(pieces),
        ),
        (
            "two-way merge-sum (recursive doubling, last stage)",
            2 * half,
            2 * half * pair + union.nnz * pair,
            lambda: a + b,
        ),
        (
            f"encode {p} reduced ranges",
            p * reduced.nnz,
            p * reduced.nnz * pair + wire,
            lambda: [encode(x) for x in parts],
        ),
        (
            f"decode {p} reduced ranges",
            p * reduced.nnz,
            wire + p * reduced.nnz * 8,
            lambda: [decode(x) for x in bufs],
        ),
        (
            f"concatenate {p} ranges into the result",
            result.nnz,
            2 * result.nnz * pair,
            lambda: SparseStream.concat(decoded),
        ),
        (
            f"decode {p} ranges straight into the result",
            result.nnz,
            wire + result.nnz * pair,
            lambda: decode_concat(bufs, [width] * p, torch.float32),
        ),
    ]


def kernel_rows(n: int, p: int, density: float, reps: int = 7) -> list[dict[str, Any]]:
    """One row per local kernel: elements, ms, ns per element, and the memory bound."""
    bw = copy_bandwidth()
    k = k_of(density, n)
    width = n // p
    isize = 4
    pair = 8 + isize  # an in-memory pair: int64 index, float32 value
    shared = stream_cases(n, p, density)
    # the concatenated result (the widening and NaN rows below read it)
    result = next(fn for name, _, _, fn in shared if name.startswith("concatenate"))()
    g = torch.Generator().manual_seed(303)
    ranks = torch.randperm(width, generator=g)[: min(result.nnz, width)].sort().values
    words4, words3 = index_low_bytes(ranks, 4), index_low_bytes(ranks, 3)
    widened = torch.empty_like(ranks)
    nat = NaturalCompression()
    dense_range = torch.randn(width, generator=torch.Generator().manual_seed(300))
    nat_payload = nat.quantize(dense_range, torch.Generator().manual_seed(301))
    draws = torch.empty(width, dtype=torch.int32)
    nat_gen = torch.Generator().manual_seed(302)
    acc = torch.randn(n, generator=torch.Generator().manual_seed(304))
    topk = TopK(k=k)
    cases: list[tuple[str, int, int, Callable[[], Any]]] = [
        # the selection a training step makes before the collective (exact top-k)
        (
            "top-k of one rank's accumulator (TopK.select)",
            n,
            n * isize + k * pair,  # one read of the accumulator, the pairs written
            lambda: topk.select(acc),
        ),
        (
            "  torch.topk of its magnitudes (reference)",
            n,
            n * isize + k * pair,
            lambda: torch.topk(acc.abs(), k, sorted=False),
        ),
        *shared,
        # reading the received index fields: a 4-byte word (what version 1 of the wire
        # format sent for a range of 2M) against sec. 5.1's 3 bytes, assembled
        (
            "  widen and check 4-byte indices",
            ranks.numel(),
            ranks.numel() * (4 + 8),
            lambda: widen_increasing(words4, 4, width, widened),
        ),
        (
            "  widen and check 3-byte indices",
            ranks.numel(),
            ranks.numel() * (3 + 8),
            lambda: widen_increasing(words3, 3, width, widened),
        ),
        # the NaN/Inf check of a header under a quantizer: the boolean-tensor way
        # against all_finite's one reduction
        (
            "NaN/Inf check of the values: isfinite().all()",
            result.nnz,
            result.nnz * isize,
            lambda: bool(torch.isfinite(result.values).all()),
        ),
        (
            "NaN/Inf check of the values: all_finite",
            result.nnz,
            result.nnz * isize,
            lambda: all_finite(result.values),
        ),
        # the quantized allreduce's kernels on one dense range (natural, 9-bit)
        (
            "natural quantize of one dense range",
            width,
            width * (isize + 4) + (9 * width + 7) // 8,  # values, draws, codes
            lambda: nat.quantize(dense_range, nat_gen),
        ),
        (
            "  of which the generator's draws",
            width,
            width * 4,
            lambda: draws.random_(generator=nat_gen),
        ),
        (
            "natural dequantize of one dense range",
            width,
            (9 * width + 7) // 8 + width * isize,
            lambda: nat.dequantize(nat_payload, torch.float32, dense_range.device),
        ),
    ]
    rows = []
    for name, elems, nbytes, fn in cases:
        s = median_seconds(fn, reps)
        rows.append(
            {
                "kernel": name,
                "elements": elems,
                "ms": s * 1e3,
                "ns_per_element": s * 1e9 / elems,
                "bound_ms": nbytes / bw * 1e3,
            }
        )
    return rows


def _rank_bound_bytes(algorithm: str, n: int, p: int, k: int, result_nnz: int) -> int:
    """Bytes one rank must read and write for one call (module docstring)."""
    isize = 4
    # a pair on the wire: the index field the default coding sends, and the value
    pair, wire_pair = 8 + isize, index_field_nbytes(n, k) / max(k, 1) + isize
    if algorithm == "ssar_split_allgather":
        mine = result_nnz // p
        return round(
            k * pair  # read its own pairs
            + 2 * k * wire_pair  # write the pieces, read the received ones
            + mine * pair  # write the reduced range
            + result_nnz * wire_pair  # read the gathered ranges
            + result_nnz * pair  # write the result
        )
    total, held, group = 0, k, 1
    d = k / n
    while group < p:
        group *= 2
        merged = int(n * (1 - (1 - d) ** group))
        total += held * pair + 2 * held * wire_pair + merged * pair
        held = merged
    return round(total)


def collective_rows(
    n: int, p: int, density: float, reps: int = 3, algorithms: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Thread CPU ms per rank per call of each algorithm on ``p`` in-process ranks."""
    bw = copy_bandwidth()
    k = k_of(density, n)
    algorithms = algorithms or ("ssar_split_allgather", "ssar_recursive_double")
    streams = [uniform_stream(n, k, r) for r in range(p)]

    def body(comm: Communicator, algorithm: str) -> tuple[list[float], int]:
        mine = streams[comm.rank]
        nnz = sparse_allreduce(mine, comm, algorithm=algorithm).nnz  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.thread_time()
            out = sparse_allreduce(mine, comm, algorithm=algorithm)
            times.append(time.thread_time() - t0)
            del out  # as a training step does: the result is used, then freed
        return times, nnz

    rows = []
    for algorithm in algorithms:
        got = run_ranks(p, body, algorithm, timeout=600.0)
        per_rank = [statistics.median(t) * 1e3 for t, _ in got]
        alone = run_ranks(p, body, algorithm, timeout=600.0, take_turns=True)
        per_rank_alone = [statistics.median(t) * 1e3 for t, _ in alone]
        nnz = got[0][1]
        nbytes = _rank_bound_bytes(algorithm, n, p, k, nnz)
        rows.append(
            {
                "algorithm": algorithm,
                "P": p,
                "N": n,
                "density": density,
                "result_nnz": nnz,
                "cpu_ms_median": statistics.median(per_rank),
                "cpu_ms_max": max(per_rank),
                "alone_cpu_ms_median": statistics.median(per_rank_alone),
                "alone_cpu_ms_max": max(per_rank_alone),
                "rank_bound_bytes": nbytes,
                "bound_ms": nbytes / bw * 1e3,
            }
        )
    return rows
