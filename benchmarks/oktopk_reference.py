"""Ok-Topk side by side with the authors' reference code, in one MPI job (issue 13).

The reference is ``AllReducer.run`` with compression ``"oktopk"`` from
``BERT/bert/allreducer.py`` of github.com/Shigangli/Ok-Topk (checked with commit
9763dccb0bf704779435cb8f66592be5a9b294bf), in a copy patched to run on CPU tensors
outside this repository (docs/benchmarks.md, "Ok-Topk against the authors'
reference code", lists the edits). None of their code is in sparcml.

    mpirun --allow-run-as-root --oversubscribe -x THP_MEM_ALLOC_ENABLE=1 -np 4 \
        .venv/bin/python benchmarks/oktopk_reference.py --reference /tmp/oktopk_ref/ref \
        -N 4M -d 0.01 --calls 32

Call ``t`` (per rank): ``x_t = acc * (1 + 0.05 t) + randn`` (seeded per rank, the
same vectors for both), a fresh state at call 0, both with sparcml's periods
(``tau' = 32``, ``tau = 64``). Time per call: the slowest rank's wall time, a
barrier before each call. The order of the two alternates across repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch's first big allocation
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--reference", default=os.environ.get("OKTOPK_REF", "/tmp/oktopk_ref/ref"))
_pre.add_argument("--pydeps", default=os.environ.get("OKTOPK_PYDEPS", ""))
_where, _ = _pre.parse_known_args()
if _where.pydeps:
    sys.path.insert(0, _where.pydeps)  # scipy, which their compression.py imports
sys.path.insert(0, _where.reference)  # their CPU-patched allreducer/compression/settings

import logging  # noqa: E402

import allreducer as ref_allreducer  # noqa: E402  (the authors' code, CPU-patched)
import compression as ref_compression  # noqa: E402
import numpy as np  # noqa: E402
import settings as ref_settings  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from sparcml.collectives import OkTopkState, sparse_allreduce  # noqa: E402
from sparcml.comm.mpi import MPICommunicator  # noqa: E402
from sparcml.stream import SparseStream  # noqa: E402
from sparcml.tools.cli.common import size_arg  # noqa: E402

ref_settings.logger.setLevel(logging.WARNING)  # their AllReducer logs 'density' per rank


class Reference:
    """The authors' Ok-Topk (AllReducer.run with compression 'oktopk'), fresh state."""

    name = "reference"

    def __init__(self, density: float, tau_prime: int, tau: int, feedback: bool) -> None:
        comp = ref_compression.compressors["oktopk"]
        comp.clear()  # class-level residual dict: fresh state
        self.comp = comp
        self.ar = ref_allreducer.AllReducer(comp, sparse=True, density=density)
        self.ar.local_threshold_recompute_interval = tau_prime
        self.ar.global_threshold_recompute_interval = tau_prime
        self.ar.region_repartition_interval = tau
        self.feedback = feedback

    def prepare(self) -> None:
        # Their run() adds its own residual to the input (error feedback built in).
        # Unless --ref-feedback, zero it (untimed) so it reduces exactly x_t, as sparcml.
        if not self.feedback:
            res = self.comp.residuals.get(self.ar._name)
            if res is not None:
                res.zero_()

    def call(self, x: torch.Tensor):
        return self.ar.run(x)  # in place: x becomes the dense result (sum / P)

    @staticmethod
    def compact(out) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.nonzero(out).view(-1)
        return idx, out[idx] * MPI.COMM_WORLD.size  # their result is the average


class Sparcml:
    name = "sparcml"

    def __init__(self, comm: MPICommunicator, k: int) -> None:
        self.comm, self.k, self.state = comm, k, OkTopkState()

    def prepare(self) -> None:
        pass

    def call(self, x: torch.Tensor):
        return sparse_allreduce(
            SparseStream.dense(x), self.comm, algorithm="oktopk", k=self.k, state=self.state
        )

    @staticmethod
    def compact(out) -> tuple[torch.Tensor, torch.Tensor]:
        return out.indices.long(), out.values


def run_period(impl, acc: torch.Tensor, calls: int, seed: int, keep: bool):
    world = MPI.COMM_WORLD
    g = torch.Generator().manual_seed(seed * 7919 + 104_729 + world.rank)
    times, results = [], []
    for t in range(calls):
        x = acc * (1 + 0.05 * t) + torch.randn(acc.numel(), generator=g)
        impl.prepare()
        world.Barrier()
        t0 = time.perf_counter()
        out = impl.call(x)
        el = time.perf_counter() - t0
        times.append(world.allreduce(el, op=MPI.MAX))
        if keep:
            results.append(impl.compact(out))
    return times, results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reference", help="the CPU-patched copy of their BERT/bert folder")
    ap.add_argument("--pydeps", help="extra import path (scipy) for their code")
    ap.add_argument("-N", type=size_arg, default=size_arg("4M"))
    ap.add_argument("-d", type=float, default=0.01, help="density (k = int(d*N))")
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--warmup", type=int, default=2, help="untimed calls per impl first (fresh state)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ref-feedback",
        action="store_true",
        help="keep the reference's built-in residual (its input becomes x_t + residual)",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, p = world.rank, world.size
    n, d = args.N, args.d
    k = int(d * n)
    defaults = OkTopkState()
    tau_prime, tau = defaults.tau_prime, defaults.tau
    comm = MPICommunicator()
    acc = torch.randn(n, generator=torch.Generator().manual_seed(args.seed * 7919 + rank))

    makers = {
        "reference": lambda: Reference(d, tau_prime, tau, args.ref_feedback),
        "sparcml": lambda: Sparcml(comm, k),
    }
    order = ["reference", "sparcml"]
    if args.warmup:
        for name in order:
            run_period(makers[name](), acc, min(args.warmup, args.calls), args.seed + 1000, False)

    times: dict[str, list[list[float]]] = {name: [] for name in order}
    kept: dict[str, list] = {}
    for rep in range(args.repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            tt, res = run_period(makers[name](), acc, args.calls, args.seed, keep=rep == 0)
            times[name].append(tt)
            if rep == 0:
                kept[name] = res
        if rank == 0:
            print(
                f"# repeat {rep}: "
                + ", ".join(
                    f"{nm} {1e3 * statistics.fmean(times[nm][-1]):.2f} ms/call" for nm in order
                ),
                flush=True,
            )

    # Loose correctness: result nnz and index overlap per call (repeat 0).
    nnz_ref, nnz_sp, ovl, vdiff, vsame = [], [], [], [], []
    for (ri, rv), (si, sv) in zip(kept["reference"], kept["sparcml"], strict=True):
        nnz_ref.append(ri.numel())
        nnz_sp.append(si.numel())
        common, ia, ib = np.intersect1d(
            ri.numpy(), si.numpy(), assume_unique=True, return_indices=True
        )
        ovl.append(common.size / max(si.numel(), 1))
        if common.size:
            a, b = rv[torch.from_numpy(ia)].double(), sv[torch.from_numpy(ib)].double()
            rel = (a - b).abs() / b.abs().clamp_min(1e-30)
            vdiff.append(float(rel.max()))
            vsame.append(float((rel <= 1e-5).double().mean()))

    if rank == 0:
        print(
            f"\nOk-Topk: P={p} N={n:,} d={d:g} k={k:,} calls={args.calls} repeats={args.repeats} "
            f"tau'={tau_prime} tau={tau} (reference intervals set to the same; "
            f"reference feedback {'ON' if args.ref_feedback else 'off (residual zeroed)'})"
        )
        hdr = (
            f"{'implementation':<11} {'P':>3} {'N':>10} {'d':>7} {'normal ms p50':>14} "
            f"{'refresh ms p50':>15} {'amortised ms':>13}"
        )
        print(hdr)
        amort = {}
        for name in order:
            normal = [x for rep in times[name] for t, x in enumerate(rep) if t % tau_prime != 0]
            refresh = [x for rep in times[name] for t, x in enumerate(rep) if t % tau_prime == 0]
            amort[name] = statistics.median(statistics.fmean(rep) for rep in times[name])
            nm = f"{1e3 * statistics.median(normal):14.2f}" if normal else f"{'-':>14}"
            print(
                f"{name:<11} {p:>3} {n:>10,} {d:>7g} {nm} {1e3 * statistics.median(refresh):15.2f} "
                f"{1e3 * amort[name]:13.2f}"
            )
        print(
            f"ratio reference/sparcml amortised: {amort['reference'] / amort['sparcml']:.2f}x "
            f"(amortised = mean over the {args.calls} calls, median over repeats)"
        )
        print(
            f"result nnz (rank 0, repeat 0) reference: min {min(nnz_ref):,} med "
            f"{int(statistics.median(nnz_ref)):,} max {max(nnz_ref):,}; "
            f"sparcml: min {min(nnz_sp):,} "
            f"med {int(statistics.median(nnz_sp)):,} max {max(nnz_sp):,}  (k={k:,})"
        )
        print(
            f"index overlap |ref & sparcml| / nnz(sparcml): call0 {ovl[0]:.4f}, "
            f"min {min(ovl):.4f}, "
            f"mean {statistics.fmean(ovl):.4f}"
        )
        if vdiff:
            print(
                f"values on common indices (ref*P vs sparcml): call0 max rel diff {vdiff[0]:.2e}; "
                f"share equal to 1e-5 rel: call0 {vsame[0]:.4f}, min {min(vsame):.4f} "
                f"(later calls differ where the ranks' reused local thresholds select differently)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
