r"""Where a DDP step with a sparcml method waits for the GPU: every host-device
synchronisation the step makes, by the sparcml line that makes it, and the step's
time split, on two ranks sharing one GPU over gloo on loopback.

Issue 30 on a GPU: ``benchmarks/gpu_train_check.sh`` measured `topk`'s sync on the
word-level LSTM 9.6 ms beyond its link at 100 Mbit/s with the model on an H200. A
synchronisation costs little on an idle GPU, but each one waits for everything
queued on the rank's stream, and two processes take turns on one GPU. This runs the
same model shape (10,000-word vocabulary, width 64, batch 20 x 35) with
``torch.cuda.set_sync_debug_mode("warn")`` over a few steps and counts the warnings by
their innermost sparcml frame (the engine thread's included), then times 30 steps::

    python benchmarks/gpu_syncs.py --methods topk,topk+natural --index-coding fixed

On a machine without a GPU, ``--device cpu`` runs the same steps (no synchronisations
to count: checks the script).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch


def worker(comm: Any, method: str, device: str, index_coding: str, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparcml.torch as st
    from sparcml.tools.recipes.language import LSTMModel

    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    net = LSTMModel(10_000, 64, 64, init_range=0.1).to(dev)
    model = DDP(net, [dev] if dev.type == "cuda" else None)
    hyper: dict[str, Any] = {"density": 0.01}
    if method != "dense":
        hyper["index_coding"] = index_coding
    state = st.register(model, method, **hyper)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(comm.rank)

    def step() -> float:
        x = torch.randint(0, 10_000, (20, 36), generator=g).to(dev)
        t0 = time.perf_counter()
        out = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 10_000), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    sites: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *a: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(src)]
        where = "outside sparcml (DDP, the model, the optimizer)"
        if frames:
            f = frames[-1]
            where = f"{os.path.relpath(f.filename, src)}:{f.lineno} {f.name}: {f.line}"
        sites[where] += 1

    sync_steps = 3
    if dev.type == "cuda":
        warnings.showwarning = record
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(sync_steps):
                step()
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    comm.barrier()
    before = (state.stats.compress_s, state.stats.communicate_s) if method != "dense" else (0, 0)
    times = [step() for _ in range(steps)]
    after = (state.stats.compress_s, state.stats.communicate_s) if method != "dense" else (0, 0)
    times.sort()
    return {
        "syncs_per_step": {k: v / sync_steps for k, v in sites.most_common()},
        "step_ms_p50": 1e3 * times[len(times) // 2],
        "compress_ms": 1e3 * (after[0] - before[0]) / steps,
        "communicate_ms": 1e3 * (after[1] - before[1]) / steps,
        "bytes_per_step": state.step_bytes[-1] if hasattr(state, "step_bytes") else None,
    }


def main() -> None:
    from sparcml.comm.launch import run_processes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dense,topk")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--index-coding", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("-P", type=int, default=2)
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
          f"load {os.getloadavg()}", flush=True)  # fmt: skip
    for method in args.methods.split(","):
        out = run_processes(args.P, worker, method, args.device, args.index_coding, args.steps,
                            timeout=120)  # fmt: skip
        r = out[0]
        print(f"\n== {method} (index coding {args.index_coding}), P = {args.P}, rank 0: step "
              f"p50 {r['step_ms_p50']:.2f} ms, hook compress {r['compress_ms']:.2f} ms, "
              f"communicate {r['communicate_ms']:.2f} ms per step, "
              f"{r['bytes_per_step']} bytes", flush=True)  # fmt: skip
        total = sum(r["syncs_per_step"].values())
        print(f"   synchronisations per step: {total:.1f}")
        for where, n in r["syncs_per_step"].items():
            print(f"   {n:6.1f}  {where}")


if __name__ == "__main__":
    main()
