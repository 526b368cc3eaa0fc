"""Fashion-MNIST with a small CNN (about 0.18 M parameters)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .base import Recipe
from .data import fashion_mnist


class FashionMNIST(Recipe):
    """Two 5x5 convolutions, two fully connected layers; SGD with momentum 0.9."""

    name = "fmnist"
    epochs = 3
    methods = ("dense", "topk", "topk+natural", "oktopk", "redsync", "natural", "qsgd")
    metric = "accuracy"
    batch = 32
    lr = 0.03

    def __init__(self, rank: int, world: int, seed: int = 0, **options: Any) -> None:
        super().__init__(rank, world, seed, **options)
        self.data = fashion_mnist()
        limit = options.get("limit")
        if limit:
            for k in ("train_x", "train_y"):
                self.data[k] = self.data[k][:limit]

    @classmethod
    def check_data(cls) -> None:
        fashion_mnist(check_only=True)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(1024, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )  # fmt: skip

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum if momentum else 0.0)

    def steps_per_epoch(self) -> int:
        return self.data["train_x"].shape[0] // self.world // self.batch

    def batches(self, epoch: int) -> Iterator[tuple[Any, torch.Tensor]]:
        idx = self.shard(self.data["train_x"].shape[0], epoch)
        for s in range(self.steps_per_epoch()):
            b = idx[s * self.batch : (s + 1) * self.batch]
            yield self.data["train_x"][b], self.data["train_y"][b]

    def loss(self, model: torch.nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs), target)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        sums = self.evaluate_part(model, 0, 1)
        return self.finish_evaluation(sums)

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> dict[str, float]:
        cut = self.test_slice(self.data["test_x"].shape[0], part, parts)
        x, y = self.on_device((self.data["test_x"][cut], self.data["test_y"][cut]))
        correct, total_loss = 0, 0.0
        for lo in range(0, x.shape[0], 1000):
            out = model(x[lo : lo + 1000])
            total_loss += float(F.cross_entropy(out, y[lo : lo + 1000], reduction="sum"))
            correct += int((out.argmax(1) == y[lo : lo + 1000]).sum())
        return {"correct": float(correct), "loss": total_loss, "count": float(x.shape[0])}

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["count"]
        return {"accuracy": sums["correct"] / n, "test_loss": sums["loss"] / n}
