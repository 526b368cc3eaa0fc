r"""The dense baseline against gloo's own allreduce, interleaved call by call.

Issue 35, item 3: ``sparse_allreduce(..., algorithm="dense")`` should cost what
gloo's in-place ``all_reduce`` costs. It returns a fresh vector (the caller's
tensor is never written), so each call writes 4N bytes of fresh memory that gloo
in place does not: the densified stream (zeros, then the pairs) or a dense
stream's copy. Run as the ranks of a torch.distributed job (``sparcml cluster
... --``), this times, in rounds (one call of each row per round, after a barrier
each; the slowest rank's time), ``--calls`` rounds after one untimed round:

* ``gloo in place``: ``dist.all_reduce`` of a tensor the rank holds (the floor);
* ``gloo, fresh clone``: ``dist.all_reduce(x.clone())`` (a fresh result);
* ``densify, then allreduce``: the dense algorithm's own work for a sparse stream
  (``comm.allreduce(stream.to_dense(), donate=True)``), without
  ``sparse_allreduce``'s consistency check;
* ``dense, sparse stream`` / ``dense, dense stream``: ``sparse_allreduce(...,
  algorithm="dense")`` for a stream of ``d N`` uniform random pairs and for a
  dense stream (copied, never written);
* ``pieces while writing``: what the library does not do (tried, measured no
  gain: docs/cluster.md): the fresh vector written piece by piece (pieces
  doubling from N/64), each piece handed to gloo (``async_op``) as soon as it is
  written, so gloo's threads reduce it while the next is written (compare with
  ``densify, then allreduce``).

Each call's diagnostics follow the table (issue 35, item 3: why the rows are
bimodal): the busiest rank's CPU time (user and system, all threads: gloo's and
the kernel's work charged to the process), its minor page faults, and the TCP
segments all ranks retransmitted (``/proc/net/snmp`` of each rank's network
namespace); then the slow calls (over 1.08x the in-place median) against the
others, and the machine's huge-page and compaction counters.

    sparcml cluster -P 8 --rate 1gbit -- \
        .venv/bin/python benchmarks/dense_baseline.py -N 16M -d 0.00781 --calls 15
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transport_floor import gloo_job  # this folder, on sys.path when run as a script

from sparcml import SparseStream
from sparcml.collectives import sparse_allreduce
from sparcml.compress.selection import k_of

SLOW = 1.08  # a call this much over the in-place median counts as slow


def minor_faults() -> int:
    """This process's minor page faults so far (a fresh page's first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_seconds() -> tuple[float, float]:
    """This process's CPU time so far, user and system, all its threads (gloo's too)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime, use.ru_stime


def retransmitted() -> int:
    """TCP segments retransmitted in this rank's network namespace so far (the whole
    namespace's: with several ranks per host, summing over ranks counts each host's
    retransmissions once per rank)."""
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    return int(tcp[1][tcp[0].index("RetransSegs")])


def vmstat() -> dict[str, int]:
    """The machine's huge-page and compaction counters (``/proc/vmstat``)."""
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k.startswith(("thp_", "compact_"))}


def slow_calls(
    floor: float, times: dict[str, list[float]], sys_cpu: dict[str, list[float]]
) -> None:
    """Print how the slow calls (over ``SLOW`` x the in-place median, every row) differ
    from the others in the busiest rank's system CPU, and the two's correlation."""
    walls = [t for v in times.values() for t in v]
    kernel = [y for v in sys_cpu.values() for y in v]
    slow = [i for i, t in enumerate(walls) if t > SLOW * floor]
    fast = [i for i in range(len(walls)) if i not in set(slow)]

    def mid(xs: list[float], at: list[int]) -> str:
        return f"{statistics.median(xs[i] for i in at):.1f}" if at else "-"

    r = statistics.correlation(walls, kernel) if len(walls) > 2 else float("nan")
    print(
        f"calls over {SLOW}x the in-place median: {len(slow)} of {len(walls)}; median wall "
        f"{mid(walls, fast)} ms (the others) vs {mid(walls, slow)} ms (slow); the busiest "
        f"rank's system CPU {mid(kernel, fast)} vs {mid(kernel, slow)} ms; correlation of "
        f"wall and system CPU over all calls {r:.2f}",
        flush=True,
    )


def main() -> None:
    args, comm = gloo_job(__doc__, calls=9)
    p, me = comm.world_size, comm.rank
    n, k = args.size, k_of(args.density, args.size)
    g = torch.Generator().manual_seed(me)
    idx = torch.randperm(n, generator=g)[:k]
    stream = SparseStream(idx, torch.randn(k, generator=g), n)
    dense = SparseStream.dense(torch.randn(n, generator=g))
    x = torch.randn(n, generator=g)
    cuts, size = [0], n // 64
    while n - cuts[-1] > 3 * size:
        cuts.append(cuts[-1] + size)
        size *= 2
    cuts.append(n)
    at = torch.searchsorted(stream.indices, torch.tensor(cuts)).tolist()

    def pieces_while_writing() -> torch.Tensor:
        out = torch.empty(n)
        works = []
        for i in range(len(cuts) - 1):
            part = out[cuts[i] : cuts[i + 1]]
            part.zero_()
            part[stream.indices[at[i] : at[i + 1]] - cuts[i]] = stream.values[at[i] : at[i + 1]]
            works.append(dist.all_reduce(part, async_op=True))
        for w in works:
            w.wait()
        return out

    rows: dict[str, Callable[[], object]] = {
        "gloo in place": lambda: dist.all_reduce(x),
        "gloo, fresh clone": lambda: dist.all_reduce(x.clone()),
        "densify, then allreduce": lambda: comm.allreduce(stream.to_dense(), donate=True),
        "dense, sparse stream": lambda: sparse_allreduce(stream, comm, "dense"),
        "dense, dense stream": lambda: sparse_allreduce(dense, comm, "dense"),
        f"pieces while writing ({len(cuts) - 1})": pieces_while_writing,
    }
    if me == 0:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
        print(
            f"P={p} N={n:,} ({4 * n / 1e6:.1f} MB) k={k:,} per rank, {args.calls} rounds "
            f"after 1 untimed, rows interleaved; THP_MEM_ALLOC_ENABLE={thp}",
            flush=True,
        )
    vm_before = vmstat()
    times: dict[str, list[float]] = {name: [] for name in rows}
    faults: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    sys_cpu: dict[str, list[float]] = {name: [] for name in rows}
    retrans: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(args.calls + 1):
        for name, fn in rows.items():
            dist.barrier()
            f0, s0, c0 = minor_faults(), retransmitted(), cpu_seconds()
            t = time.perf_counter()
            fn()
            took = time.perf_counter() - t
            # the slowest rank's time, the most faults and CPU of a rank, retransmissions
            # of all ranks
            (u0, y0), (u1, y1) = c0, cpu_seconds()
            worst = torch.tensor(
                [took, minor_faults() - f0, u1 - u0 + y1 - y0, y1 - y0], dtype=torch.float64
            )
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            sent = torch.tensor([retransmitted() - s0], dtype=torch.float64)
            dist.all_reduce(sent)
            if r:
                times[name].append(float(worst[0]) * 1e3)
                faults[name].append(float(worst[1]))
                cpu[name].append(float(worst[2]) * 1e3)
                sys_cpu[name].append(float(worst[3]) * 1e3)
                retrans[name].append(float(sent))
    if me == 0:
        floor = statistics.median(times["gloo in place"])
        print(f"{'row (slowest rank, ms)':34s} {'p50':>9s} {'p25-p75':>17s} {'min':>8s} "
              f"{'max':>8s} {'vs in place':>11s}")  # fmt: skip
        for name, v in times.items():
            q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
            mid = statistics.median(v)
            print(
                f"{name:34s} {mid:9.2f} {q[0]:8.2f}-{q[2]:8.2f} {min(v):8.2f} {max(v):8.2f} "
                f"{mid / floor:10.3f}x",
                flush=True,
            )
        print("per call (in order): slowest rank's ms / most CPU ms of a rank (user + sys, "
              "all threads) / most system CPU ms of a rank / most minor page faults of a "
              "rank / TCP segments retransmitted, all ranks")  # fmt: skip
        for name in rows:
            print(f"{name}:")
            per_call = zip(
                times[name], cpu[name], sys_cpu[name], faults[name], retrans[name], strict=True
            )
            for t, c, y, f, s in per_call:
                print(f"  {t:9.2f} ms {c:8.2f} cpu ms {y:8.2f} sys ms {f:8.0f} faults "
                      f"{s:6.0f} retransmitted")  # fmt: skip
        slow_calls(floor, times, sys_cpu)
        after = vmstat()
        moved = {k: after[k] - v for k, v in vm_before.items() if after.get(k, v) != v}
        print(f"/proc/vmstat during the rounds (whole machine): {moved or 'no change'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
