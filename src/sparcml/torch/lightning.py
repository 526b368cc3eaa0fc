"""PyTorch Lightning: a callback that switches a ``Trainer``'s DDP to a sparcml method.

    from sparcml.torch.lightning import SparcmlCallback

    trainer = lightning.Trainer(strategy="ddp", callbacks=[SparcmlCallback("topk", density=0.01)])

The callback builds the :class:`~sparcml.torch.SparcmlState` (a collective
object: a dedicated process group of its own, and a check that every rank runs
the same method and parameters) at ``on_fit_start``, when the strategy has
created the process group and wrapped the model in DDP, and registers it exactly
as :func:`sparcml.torch.register` does; ``callback.state`` is the state (bytes,
checkpoints), and layer rules by parameter name work.

PyTorch's hook convention works too: ``state, hook = sparcml.torch.comm_hook(...)``
in ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)`` (the state is built at
the first bucket). Lightning registers such hooks on CUDA devices only; on CPU
ranks it ignores them silently (``examples/lightning_train.py --strategy-hook``
shows a strategy that registers them there too).

Requires the ``lightning`` package (``pip install lightning``); this module is
not imported by ``sparcml.torch``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from .hook import register
from .state import SparcmlState, needs_momentum_correction

__all__ = ["SparcmlCallback"]


class SparcmlCallback(pl.Callback):
    """Register a sparcml method on the Trainer's DDP model when fitting starts.

    Args:
        method: see :func:`sparcml.torch.methods`.
        **hyper: :class:`~sparcml.torch.SparcmlState` hyperparameters
            (``density=``, ``momentum=`` for DGC momentum correction, ...).

    Raises:
        TypeError (at ``on_fit_start``): the strategy did not wrap the model in DDP
            (use ``strategy="ddp"``).
    """

    def __init__(self, method: str = "topk", **hyper: Any) -> None:
        self.method = method
        self.hyper = hyper
        self.state: SparcmlState | None = None
        self._ddp: DistributedDataParallel | None = None  # the wrapper registered on

    @staticmethod
    def needs_momentum_correction(method: str) -> bool:
        """Whether the optimizer should run without momentum (give it to the state)."""
        return needs_momentum_correction(method)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"SparcmlCallback needs strategy='ddp' (the model is a {type(model).__name__})"
            )
        if self.state is None:
            self.state = register(model, self.method, **self.hyper)
        elif model is not self._ddp:
            # a later fit (Lightning wraps the module in a new DDP each time): the same
            # state, its residuals kept by parameter name, registered on the new wrapper
            # (it used to go on with plain dense DDP, silently)
            self.state.registered = None
            register(model, state=self.state)
        self._ddp = model
