"""``sparcml bench-ina --env``: the aggregator against gloo's ring allreduce, same links.

Run inside ``sparcml cluster -P <workers + 1>``: the last host runs the aggregator
(a host of its own, like a switch port), the others are workers. In one run, on
the same float32 vectors: gloo ring ``all_reduce`` among the workers, then
:func:`~sparcml.ina.ina_allreduce` in ``natural`` (8-bit) and ``fixed`` (int32)
mode. Reports median time, values aggregated per second, and bytes per value
each worker sent (headers included).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ...ina import AggregatorServer, InaSession, InaStats, ina_allreduce

__all__ = ["run_ina_bench"]


def run_ina_bench(size: int, repeats: int, chunk: int = 1024) -> list[dict[str, Any]] | None:
    """One rank of the benchmark (torch.distributed initialised from env://)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("bench-ina needs at least 2 hosts: workers and the aggregator")
    workers = world - 1
    me = os.environ.get("SPARCML_HOST_ADDR", "127.0.0.1")
    addrs: list[Any] = [None] * world
    dist.all_gather_object(addrs, me)
    group = dist.new_group(list(range(workers)))
    server_host = addrs[-1]
    port = 47001
    if rank == workers:  # the aggregator's host
        with AggregatorServer(host=server_host, port=port, slots=4096):
            dist.barrier()  # serving
            dist.barrier()  # the workers are done
        return None
    dist.barrier()
    # one session per mode (a session has one mode), drawn by worker 0 and shared
    sessions: list[Any] = (
        [InaSession.create(workers, m) for m in ("natural", "fixed")] if rank == 0 else [None] * 2
    )
    dist.broadcast_object_list(sessions, src=0, group=group)
    x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    rows = []
    times: dict[str, list[float]] = {"gloo ring all_reduce": [], "ina natural": [], "ina fixed": []}
    sent: dict[str, int] = {}
    call = 0
    for it in range(repeats + 1):  # the first round warms up
        y = x.clone()
        dist.barrier(group)
        t = time.perf_counter()
        dist.all_reduce(y, group=group)
        if it:
            times["gloo ring all_reduce"].append(time.perf_counter() - t)
        sent["gloo ring all_reduce"] = int(2 * (workers - 1) / workers * size * 4)
        for mode in ("natural", "fixed"):
            stats = InaStats()
            dist.barrier(group)
            t = time.perf_counter()
            session = sessions[0] if mode == "natural" else sessions[1]
            ina_allreduce(x * 0.01 if mode == "fixed" else x, (server_host, port), session, rank,
                          workers, mode, chunk=chunk, window=256, call=call, stats=stats,
                          timeout=60)  # fmt: skip
            call += 1
            if it:
                times[f"ina {mode}"].append(time.perf_counter() - t)
            sent[f"ina {mode}"] = stats.bytes_sent
    worst = {}
    for name, ts in times.items():
        med = torch.tensor([statistics.median(ts)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
        worst[name] = float(med)
    dist.barrier()
    if rank != 0:
        return None
    for name, t in worst.items():
        rows.append(
            {
                "method": name,
                "median_s": t,
                "values_per_s": size / t,
                "bytes_per_value": sent[name] / size,
                "vs_gloo": worst["gloo ring all_reduce"] / t,
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]], size: int, workers: int, rate: str) -> str:
    lines = [
        f"{workers} workers + 1 aggregator host, {rate} links, {size:,} float32 values per worker",
        f"{'method':<22} {'median s':>9} {'values/s':>12} {'bytes/value sent':>17} {'vs gloo':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['method']:<22} {r['median_s']:9.3f} {r['values_per_s']:12.3g} "
            f"{r['bytes_per_value']:17.3f} {r['vs_gloo']:7.2f}x"
        )
    return "\n".join(lines)
