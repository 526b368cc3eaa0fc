"""A plain DDP training script switched to sparcml with three lines (marked).

Run: .venv/bin/torchrun --nproc-per-node 4 examples/ddp_train.py [--method topk]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparcml.torch  # (1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="topk", help="see `sparcml methods`")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    print_if_root = train(args)
    if dist.get_rank() == 0:
        print(print_if_root)
    # after train() returned: a DDP model still alive at destroy_process_group would
    # free the process group later, with the GIL held, and that deadlocks now and then
    # against gloo's worker threads (pytorch/pytorch#56297)
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> str:
    """Train ``args.steps`` steps; the final loss and whether the ranks agree."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    )
    # Methods with error feedback (topk, oktopk, redsync, ...) take the momentum in the
    # state (DGC momentum correction) and a plain SGD optimizer: the optimizer's momentum
    # on top of their residuals amplifies both, and training diverges.
    correct = sparcml.torch.needs_momentum_correction(args.method)
    hyper = {"momentum": 0.9} if correct else {}
    state = sparcml.torch.register(model, method=args.method, density=args.density, **hyper)  # (2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if correct else 0.9)

    g = torch.Generator().manual_seed(rank)  # each rank its own data
    target = torch.nn.Linear(64, 8)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # the hook reduces the gradient buckets in the background
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(
                f"step {step:3d} loss {loss.item():.4f} sent {state.step_bytes[-1]:,} bytes"
            )  # (3)

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    same = all(torch.equal(p, gathered[0]) for p in gathered)
    return f"{args.method}: final loss {loss.item():.4f}; models identical on every rank: {same}"


if __name__ == "__main__":
    main()
