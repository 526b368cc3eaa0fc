"""A PyTorch Lightning script switched to sparcml with a callback (two marked lines).

Run: .venv/bin/torchrun --nproc-per-node 2 examples/lightning_train.py [--method topk]
(needs `pip install lightning`; docs/integrations.md)
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from sparcml.torch.lightning import SparcmlCallback  # (1)


class Regression(pl.LightningModule):
    def __init__(self, momentum: float) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )
        self.momentum = momentum

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=self.momentum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="topk", help="see `sparcml methods`")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(64, 8)
    x = torch.randn(32 * args.steps * 2, 64, generator=g)
    with torch.no_grad():
        y = target(x)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    # error-feedback methods take the momentum in the state (DGC momentum correction)
    correct = SparcmlCallback.needs_momentum_correction(args.method)
    hyper = {"momentum": 0.9} if correct else {}
    callback = SparcmlCallback(args.method, density=args.density, **hyper)  # (2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
        max_steps=args.steps, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model = Regression(momentum=0.0 if correct else 0.9)
    trainer.fit(model, data)

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    if dist.get_rank() == 0:
        same = all(torch.equal(p, gathered[0]) for p in gathered)
        loss = float(trainer.callback_metrics["loss"])
        assert callback.state is not None
        print(f"{args.method}: final loss {loss:.4f}; sent {callback.state.bytes_sent:,} bytes; "
              f"models identical on every rank: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
