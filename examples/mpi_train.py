"""Training without DDP on the MPI transport (mpi4py), with sparcml.torch.sync_gradients.

Run: .venv/bin/mpirun -n 4 --oversubscribe .venv/bin/python examples/mpi_train.py
(as root add --allow-run-as-root).
"""

from __future__ import annotations

import argparse

import torch

import sparcml.torch
from sparcml.comm import MPICommunicator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="topk")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    comm = MPICommunicator()
    torch.manual_seed(comm.rank)  # different initial models: broadcast_parameters fixes that
    state = sparcml.torch.SparcmlState(args.method, density=args.density, comm=comm)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    sparcml.torch.broadcast_parameters(model, state)  # rank 0's initial model everywhere
    opt = sparcml.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, state
    )
    g = torch.Generator().manual_seed(comm.rank)
    torch.manual_seed(0)
    target = torch.nn.Linear(64, 8)  # the same task on every rank
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # sync_gradients, then the SGD step
        if comm.rank == 0 and step % 10 == 0:
            print(f"step {step:3d} loss {loss.item():.4f} sent {state.step_bytes[-1]:,} bytes")
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same = all(torch.equal(p, params) for p in comm.allgather(params))
    if comm.rank == 0:
        print(
            f"{args.method}: final loss {loss.item():.4f}; models identical on every rank: {same}"
        )
    comm.close()


if __name__ == "__main__":
    main()
