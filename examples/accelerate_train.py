"""A Hugging Face Accelerate script switched to sparcml (two marked lines).

Run: .venv/bin/torchrun --nproc-per-node 2 examples/accelerate_train.py [--method topk]
(or `accelerate launch`; needs `pip install accelerate`; docs/integrations.md)
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from accelerate import Accelerator

import sparcml.torch  # (1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="topk", help="see `sparcml methods`")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    train_and_report(args)
    # tear the process group down before the interpreter does: gloo's threads must
    # not outlive it into finalization (an abort at exit, now and then, otherwise).
    # Called once the DDP wrapper is gone (train_and_report returned, the collector
    # ran): a wrapper still alive would free the process group later, with the GIL
    # held, and that deadlocks now and then against gloo's worker threads
    # (pytorch/pytorch#56297)
    gc.collect()
    dist.destroy_process_group()


def train_and_report(args: argparse.Namespace) -> None:
    """Train ``args.steps`` steps; the main process prints the loss, the bytes sent and
    whether the ranks' models agree."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    correct = sparcml.torch.needs_momentum_correction(args.method)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if correct else 0.9)
    model, opt = accelerator.prepare(model, opt)  # model is now DDP-wrapped
    hyper = {"momentum": 0.9} if correct else {}
    state = sparcml.torch.register(model, method=args.method, density=args.density, **hyper)  # (2)

    g = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own data
    target = torch.nn.Linear(64, 8)
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    if accelerator.is_main_process:
        same = all(torch.equal(p, gathered[0]) for p in gathered)
        print(f"{args.method}: final loss {loss.item():.4f}; sent {state.bytes_sent:,} bytes; "
              f"models identical on every rank: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
