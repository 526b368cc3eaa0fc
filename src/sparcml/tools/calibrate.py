"""``sparcml calibrate``: measure alpha, beta and gamma on the current transport.

The cost model (:mod:`sparcml.costmodel`, paper 000 sec. 5.2) charges
``alpha + beta L`` for a message of ``L`` bytes and ``gamma`` per element reduced.
Measured here, on whatever transport the ranks use (loopback, an emulated
cluster, a real network):

1. **alpha, beta_sparse** — ping-pong between ranks 0 and 1 through sparcml's own
   point-to-point path (the unknown-size protocol the sparse collectives use),
   over payloads from 0 bytes to a few MB: ``alpha`` is the median one-way time of
   the empty message, ``beta_sparse`` the least-squares slope of the time against
   the size over the large messages (:func:`fit_alpha_beta`, :func:`fit_slope`).
2. **beta** (dense words) — the transport's dense allreduce of float32 vectors;
   with ring volume ``2(P-1)/P n isize``: the slope of ``T - (P-1)/P n gamma_dense``
   against the volume over the large sizes (:func:`fit`).
3. **gamma** — local cost per element of a sparse-stream sum (merging two sorted
   streams), the reduction the sparse algorithms perform; the dense add per
   element is reported alongside.
4. **alpha_intra, beta_intra** — the ping-pong of step 1 between two ranks of one
   node. On ranks that span several nodes (:attr:`~sparcml.comm.Communicator.topology`)
   step 1 pairs rank 0 with the first rank of the next node (through the NICs)
   and this step with the next rank of its own node; on a single node both
   pairs are the same link, and so are both figures.

The result is written where ``algorithm="auto"`` finds it
(``$SPARCML_CALIBRATION`` or ``~/.config/sparcml/calibration.json``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..comm import Communicator
from ..costmodel import CostModel
from ..stream import SparseStream

__all__ = ["fit", "fit_alpha_beta", "fit_line", "fit_slope", "measure"]

PING_SIZES = (0, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
DENSE_SIZES = (1 << 18, 1 << 20, 1 << 22)  # float32 elements


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``, ``a`` clamped at 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return max(my - b * mx, 0.0), max(b, 0.0)


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """alpha: the one-way time of the empty message (measured, not extrapolated: a
    shaper's burst makes mid-size messages look cheap and pulls a free intercept
    to zero); beta: the slope over the large messages (:func:`fit_slope`). Without
    an empty message: a free line fit."""
    if 0.0 not in sizes:
        return fit_line(sizes, times)
    alpha = times[sizes.index(0.0)]
    return alpha, fit_slope(sizes, times, alpha)


def fit_slope(sizes: list[float], times: list[float], alpha: float = 0.0) -> float:
    """Time per byte: the least-squares slope of a free line through the sizes of at
    least a quarter of the largest, where there are two or more.

    A rate shaper's burst (``tc tbf``'s bucket), a first segment sent before the
    link is busy, a pipelined ring's latencies: each saves or costs the same time
    at every large size, so it moves a free line's intercept and leaves its slope,
    the link's time per byte. A line through ``(0, alpha)`` turns that constant
    into slope: on a 1 Gbit/s link with a 256 KB burst it gave 7.9 ns/B, a
    faster-than-the-link 1.01 Gbit/s (the wire with TCP/IP headers: 8.37 ns/B;
    the free slope of the same measurements 8.50). With fewer than two large
    sizes: ``t - alpha`` fitted through the origin.
    """
    top = max(sizes, default=0.0)
    large = [(s, t) for s, t in zip(sizes, times, strict=True) if s > 0 and s >= top / 4]
    if len(large) >= 2:
        return fit_line([s for s, _ in large], [t for _, t in large])[1]
    num = sum(s * (t - alpha) for s, t in zip(sizes, times, strict=True))
    den = sum(s * s for s in sizes)
    return max(num / den, 0.0) if den else 0.0


def _pingpong(comm: Communicator, nbytes: int, repeats: int, peer: int = 1) -> float:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):  # the first round warms up
        comm.barrier()
        t = time.perf_counter()
        if comm.rank == 0:
            comm.send(buf, peer)
            comm.recv(peer)
        elif comm.rank == peer:
            got = comm.recv(0)
            comm.send(got, 0)
        times.append((time.perf_counter() - t) / 2)
    return statistics.median(times[1:])


def _gamma(repeats: int) -> tuple[float, float]:
    n, k = 1 << 22, 1 << 18
    g = torch.Generator().manual_seed(0)
    a = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
    b = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
    sparse, dense = [], []
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for _ in range(repeats):
        t = time.perf_counter()
        SparseStream.sum([a, b])
        sparse.append((time.perf_counter() - t) / (2 * k))
        t = time.perf_counter()
        x.add_(y)
        dense.append((time.perf_counter() - t) / n)
    return statistics.median(sparse), statistics.median(dense)


def measure(
    comm: Communicator,
    repeats: int = 7,
    ping_sizes: tuple[int, ...] = PING_SIZES,
    dense_sizes: tuple[int, ...] = DENSE_SIZES,
) -> dict[str, Any]:
    """Steps 1-3 above (a collective: every rank calls it). Returns the figures."""
    if comm.world_size < 2:
        raise ValueError("calibration needs at least 2 ranks")
    topo = comm.topology
    nodes = not topo.is_flat
    # step 1 between nodes where there are several (rank 0 and the next node's first)
    across = topo.nodes[1][0] if topo.num_nodes > 1 else 1
    pings = [_pingpong(comm, s, repeats, across) for s in ping_sizes]
    # step 4 inside rank 0's node (the same link as step 1 unless there are nodes)
    inside_pings = (
        [_pingpong(comm, s, repeats, topo.nodes[0][1]) for s in ping_sizes] if nodes else pings
    )
    gamma, gamma_dense = _gamma(repeats)
    p = comm.world_size
    dense_times = []
    for n in dense_sizes:
        x = torch.ones(n)
        comm.allreduce(x)
        ts = []
        for _ in range(repeats):
            comm.barrier()
            t = time.perf_counter()
            comm.allreduce(x)
            ts.append(time.perf_counter() - t)
        dense_times.append(statistics.median(ts))
    raw = {
        "topology": str(topo),
        "world_size": p,
        "ping_sizes": list(ping_sizes),
        "ping_one_way_s": pings,
        "inside_ping_one_way_s": inside_pings,
        "dense_sizes": list(dense_sizes),
        "dense_allreduce_s": dense_times,
        "gamma": gamma,
        "gamma_dense": gamma_dense,
    }
    # every rank must store the same numbers: rank 0's measurements, fitted alike
    mine = torch.tensor(
        [*pings, *inside_pings, *dense_times, gamma, gamma_dense], dtype=torch.float64
    )
    agreed = comm.allgather(mine)[0].tolist()
    i, j, k = len(pings), 2 * len(pings), 2 * len(pings) + len(dense_times)
    raw.update(
        ping_one_way_s=agreed[:i],
        inside_ping_one_way_s=agreed[i:j],
        dense_allreduce_s=agreed[j:k],
        gamma=agreed[k],
        gamma_dense=agreed[k + 1],
    )
    return fit(raw)


def fit(raw: dict[str, Any]) -> dict[str, Any]:
    """The model's figures from the measurements of :func:`measure` (also from the
    ``--json`` figures of an earlier calibration: ``sparcml calibrate --refit``).

    alpha, beta_sparse: step 1's ping-pong (:func:`fit_alpha_beta`); alpha_intra,
    beta_intra: step 4's; beta: the slope (:func:`fit_slope`) of step 2's dense
    allreduce time, less its ``(P-1)/P n gamma_dense`` of additions, against the
    ring's volume ``2(P-1)/P n 4`` bytes (its ``2(P-1)`` latencies, pipelined with
    the transfers, stay in the intercept).

    Raises:
        ValueError: a measurement is missing.
    """
    try:
        sizes = [float(s) for s in raw["ping_sizes"]]
        pings = [float(t) for t in raw["ping_one_way_s"]]
        inside = [float(t) for t in raw.get("inside_ping_one_way_s") or pings]
        dense_sizes = [int(n) for n in raw["dense_sizes"]]
        dense_times = [float(t) for t in raw["dense_allreduce_s"]]
        p = int(raw["world_size"])
        gamma, gamma_dense = float(raw["gamma"]), float(raw["gamma_dense"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not the measurements of a calibration: {e!r}") from e
    if (
        len(pings) != len(sizes)
        or len(inside) != len(sizes)
        or len(dense_times) != len(dense_sizes)
    ):
        raise ValueError("a calibration's sizes and times differ in number")
    alpha, beta_sparse = fit_alpha_beta(sizes, pings)
    alpha_intra, beta_intra = fit_alpha_beta(sizes, inside)
    volumes = [2 * (p - 1) / p * n * 4 for n in dense_sizes]
    work = [
        t - (p - 1) / p * n * gamma_dense for n, t in zip(dense_sizes, dense_times, strict=True)
    ]
    beta = fit_slope(volumes, work, 2 * (p - 1) * alpha)
    return {
        **raw,
        "alpha": alpha,
        "beta": beta,
        "beta_sparse": beta_sparse,
        "gamma": gamma,
        "gamma_dense": gamma_dense,
        "alpha_intra": alpha_intra,
        "beta_intra": beta_intra,
    }


def to_model(figures: dict[str, Any], source: str = "calibrated") -> CostModel:
    return CostModel(
        alpha=figures["alpha"],
        beta=figures["beta"],
        gamma=figures["gamma"],
        beta_sparse=figures["beta_sparse"],
        gamma_dense=figures.get("gamma_dense"),
        alpha_intra=figures.get("alpha_intra", CostModel.alpha_intra),
        beta_intra=figures.get("beta_intra", CostModel.beta_intra),
        source=source,
    )
