"""Checkpoint and resume a sparcml DDP run with ``torch.distributed.checkpoint`` (DCP).

Trains ``--steps`` steps, saves model, optimizer and the sparcml state with
``dcp.save``, then builds everything afresh (as a new job would), loads it with
``dcp.load`` and trains ``--steps`` more; an uninterrupted run of twice as many
steps must end with the same parameters, bit for bit.

Run: .venv/bin/torchrun --nproc-per-node 2 examples/dcp_checkpoint.py [--method topk]
(docs/training.md, "Checkpoint and resume")
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import sparcml.torch
from sparcml.torch.checkpoint import dcp_entry, load_dcp_entry


def build(method: str) -> tuple[DDP, torch.optim.Optimizer, sparcml.torch.SparcmlState]:
    """A fresh model, optimizer and sparcml state (the same on every rank)."""
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    )
    state = sparcml.torch.register(model, method, density=0.05, momentum=0.9)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), state


def train(model: DDP, opt: torch.optim.Optimizer, start: int, steps: int) -> None:
    rank = dist.get_rank()
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + t)  # this rank's batch of step t
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def params(model: DDP) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="topk", help="see `sparcml methods`")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpoint", help="DCP folder (default: a temporary one, removed)")
    parser.add_argument(
        "--without-sparcml-state",
        action="store_true",
        help="restore model and optimizer only (the residuals lost: the runs then differ)",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    same = resume_and_compare(args)
    flags = [torch.tensor([int(same)]) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(same)]))
    if dist.get_rank() == 0:
        print(f"{args.method}: resumed run bitwise the uninterrupted one on every rank: "
              f"{all(bool(f) for f in flags)}")  # fmt: skip
    # the DDP models are gone (resume_and_compare returned): a DDP model still alive
    # here would free the process group itself, later, with the GIL held, and that
    # deadlocks now and then against gloo's worker threads (pytorch/pytorch#56297)
    dist.destroy_process_group()


def resume_and_compare(args: argparse.Namespace) -> bool:
    """Train, save, load into fresh objects, train on; True if the resumed run ends
    bitwise where an uninterrupted run of as many steps does."""
    rank = dist.get_rank()
    path = [args.checkpoint or (tempfile.mkdtemp() if rank == 0 else None)]
    dist.broadcast_object_list(path)  # one folder for every rank

    model, opt, state = build(args.method)
    train(model, opt, 0, args.steps)
    model_sd, optim_sd = get_state_dict(model, opt)
    # (the sparcml state is per rank: a rank-keyed entry, not deduplicated by DCP)
    dcp.save(
        {"model": model_sd, "optim": optim_sd, **dcp_entry(state, rank)}, checkpoint_id=path[0]
    )

    # a new job: everything built afresh, then loaded
    model, opt, state = build(args.method)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd, **dcp_entry(state, rank)}
    dcp.load(sd, checkpoint_id=path[0])
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if not args.without_sparcml_state:
        load_dcp_entry(state, sd, rank)
    train(model, opt, args.steps, args.steps)
    resumed = params(model)

    model, opt, _ = build(args.method)
    train(model, opt, 0, 2 * args.steps)
    dist.barrier()  # every rank has read the checkpoint
    if rank == 0 and not args.checkpoint:
        shutil.rmtree(path[0])
    return bool(torch.equal(resumed, params(model)))


if __name__ == "__main__":
    main()
