"""A PyTorch Lightning script switched to sparcml with a callback (two marked lines),
or with PyTorch's hook convention through Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)`` (``--strategy-hook``).

Run: .venv/bin/torchrun --nproc-per-node 2 examples/lightning_train.py [--method topk]
[--strategy-hook] (needs `pip install lightning`; docs/integrations.md)
"""

from __future__ import annotations

import argparse
import gc
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import sparcml.torch
from sparcml.torch.lightning import SparcmlCallback  # (1)


class CPUHookDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy registers ``ddp_comm_hook`` on CUDA devices only (its
    ``_register_ddp_hooks`` skips CPU, citing a PyTorch 1.8 limitation that no longer
    holds): on CPU ranks the hook would be silently ignored. This registers it there
    too, with Lightning's own registration function; on GPUs plain ``DDPStrategy``."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":
            super()._register_ddp_hooks()
            return
        from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )


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
    parser.add_argument(
        "--strategy-hook",
        action="store_true",
        help="sparcml.torch.comm_hook() in DDPStrategy(ddp_comm_state=, ddp_comm_hook=) "
        "instead of the callback",
    )
    parser.add_argument(
        "--fits", type=int, default=1, help="fit this many times (a Trainer per fit, one callback)"
    )
    args = parser.parse_args()
    if args.strategy_hook and args.fits > 1:
        # (Lightning takes a strategy instance for one Trainer only)
        parser.error("--fits > 1 is for the callback; --strategy-hook fits once")
    fit_and_report(args)
    # PyTorch's documented shutdown: without it gloo's worker threads can outlive the
    # interpreter and abort the process at exit (pytorch/pytorch#190489); Lightning's own
    # atexit hook does the same later, when it is too late for some of them. Called once
    # the DDP wrappers are gone (fit_and_report returned, the collector ran): a wrapper
    # still alive would free the process group later, with the GIL held, and that
    # deadlocks now and then against gloo's worker threads (pytorch/pytorch#56297).
    gc.collect()
    dist.destroy_process_group()


def fit_and_report(args: argparse.Namespace) -> None:
    """Fit ``args.fits`` times; rank 0 prints the loss, the bytes sent and whether the
    ranks' models agree."""
    g = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(64, 8)
    x = torch.randn(32 * args.steps * 2, 64, generator=g)
    with torch.no_grad():
        y = target(x)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    # error-feedback methods take the momentum in the state (DGC momentum correction)
    correct = SparcmlCallback.needs_momentum_correction(args.method)
    hyper = {"momentum": 0.9} if correct else {}
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.strategy_hook:  # PyTorch's (state, hook) pair, built at the first bucket
        hook_state, hook = sparcml.torch.comm_hook(args.method, density=args.density, **hyper)
        strategy: object = CPUHookDDPStrategy(ddp_comm_state=hook_state, ddp_comm_hook=hook)
        callbacks = []
    else:
        callback = SparcmlCallback(args.method, density=args.density, **hyper)  # (2)
        strategy, callbacks = "ddp", [callback]
    model = Regression(momentum=0.0 if correct else 0.9)
    sent_per_fit = []
    for _ in range(args.fits):  # (the callback's state, and its residuals, carry over)
        trainer = pl.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy,
            max_steps=args.steps, callbacks=callbacks,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        before = callback.state.bytes_sent if not args.strategy_hook and callback.state else 0
        trainer.fit(model, data)
        if not args.strategy_hook and callback.state is not None:
            sent_per_fit.append(callback.state.bytes_sent - before)

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    if dist.get_rank() == 0:
        same = all(torch.equal(p, gathered[0]) for p in gathered)
        loss = float(trainer.callback_metrics["loss"])
        state = hook_state.built if args.strategy_hook else callback.state
        assert state is not None, "the hook never ran: DDP reduced without it"
        print(f"{args.method}: final loss {loss:.4f}; sent {state.bytes_sent:,} bytes; "
              f"models identical on every rank: {same}", flush=True)  # fmt: skip
        if args.fits > 1:
            print(f"bytes sent per fit: {sent_per_fit}", flush=True)


if __name__ == "__main__":
    main()
