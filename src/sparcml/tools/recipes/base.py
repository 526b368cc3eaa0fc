"""What a recipe provides to the shared training loop (:mod:`.train`)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch


class Recipe(abc.ABC):
    """A dataset, a model, an optimizer and an evaluation, for ``world`` ranks.

    Class attributes give the defaults the command line shows: ``epochs``,
    ``methods`` (those that apply), ``metric`` (the headline test figure) and
    whether higher is better.
    """

    name: str = ""
    epochs: int = 1
    methods: tuple[str, ...] = ("dense", "topk")
    metric: str = "accuracy"
    higher_is_better: bool = True
    #: the optimizer's momentum in dense training; sparse methods with error feedback
    #: carry it as DGC momentum correction instead (0: plain SGD, no correction)
    momentum: float = 0.9
    #: the options ``sparcml train --recipe-option KEY=VALUE`` may set
    options_taken: tuple[str, ...] = ()

    def __init__(self, rank: int, world: int, seed: int = 0, **options: Any) -> None:
        self.rank, self.world, self.seed = rank, world, seed
        self.options = options
        #: where the model runs (the harness sets it; ``sparcml train --device``): the
        #: data stays in host memory and every batch is moved there by :meth:`on_device`
        self.device = torch.device("cpu")

    def on_device(self, data: Any) -> Any:
        """``data`` (a tensor, or a tuple or list of them) on :attr:`device`."""
        if isinstance(data, torch.Tensor):
            return data.to(self.device, non_blocking=True)
        if isinstance(data, (tuple, list)):
            return type(data)(self.on_device(x) for x in data)
        return data

    @classmethod
    def check_methods(cls, methods: list[str], options: dict[str, Any]) -> None:
        """Raise ``ValueError`` if these methods cannot train with these options
        (before any rank starts); every combination can, unless a recipe says."""
        return None

    @classmethod
    def check_data(cls) -> None:
        """Raise :class:`~sparcml.tools.recipes.data.DataMissingError` if the data is absent."""
        return None

    @abc.abstractmethod
    def model(self) -> torch.nn.Module:
        """A fresh model, initialised from ``self.seed`` (the same on every rank)."""

    @abc.abstractmethod
    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        """The optimizer; ``momentum=False`` when the method does DGC momentum correction
        (the momentum then lives in the sparcml state, RedSync sec. 3.5)."""

    @abc.abstractmethod
    def batches(self, epoch: int) -> Iterator[tuple[Any, torch.Tensor]]:
        """This rank's shard of the training set for ``epoch`` (same count on every rank)."""

    @abc.abstractmethod
    def steps_per_epoch(self) -> int: ...

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Test-set figures; must include ``self.metric`` and ``"test_loss"``."""

    def evaluate_part(
        self, model: torch.nn.Module, part: int, parts: int
    ) -> dict[str, float] | None:
        """Sums over the ``part``-th of ``parts`` slices of the test set, for evaluating
        on every rank at once (added up over the ranks, then :meth:`finish_evaluation`);
        ``None``: not supported, rank 0 runs :meth:`evaluate` alone."""
        return None

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        """Test figures from the summed :meth:`evaluate_part` results."""
        raise NotImplementedError

    def test_slice(self, n: int, part: int, parts: int) -> slice:
        """Contiguous share ``part`` of ``parts`` of ``n`` test examples."""
        return slice(n * part // parts, n * (part + 1) // parts)

    def clip(self, model: torch.nn.Module) -> None:
        """Gradient clipping after synchronisation (none by default)."""
        return None

    def shard(self, n: int, epoch: int) -> torch.Tensor:
        """Indices of this rank's equal share of ``n`` examples, shuffled per epoch."""
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        perm = torch.randperm(n, generator=g)
        per = n // self.world
        return perm[self.rank * per : (self.rank + 1) * per]
