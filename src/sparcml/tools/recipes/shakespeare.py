"""Character-level language modelling on Shakespeare's plays with an LSTM."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .base import Recipe
from .data import shakespeare, shakespeare_archive


class CharLSTM(torch.nn.Module):
    def __init__(self, vocab: int, embed: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.lstm = torch.nn.LSTM(embed, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h)


class Shakespeare(Recipe):
    """One-layer LSTM (256 units) over characters; SGD (lr 1, momentum 0.9) with
    gradient clipping at norm 1 (RedSync trains its LSTMs with vanilla SGD and
    clipping, sec. 4); the last 10% of the text held out.

    Reported metric: test perplexity per character (lower is better).
    """

    name = "shakespeare"
    epochs = 3
    methods = ("dense", "topk", "natural", "oktopk", "redsync")
    metric = "perplexity"
    higher_is_better = False
    seq = 64
    batch = 16
    chars = 1_500_000

    def __init__(self, rank: int, world: int, seed: int = 0, **options: Any) -> None:
        super().__init__(rank, world, seed, **options)
        limit = options.get("limit")
        # limit counts training sequences (samples), like the other recipes' examples:
        # enough characters for that many sequences in the 90% training part
        chars = math.ceil((limit * self.seq + 1) / 0.9) + self.seq + 1 if limit else self.chars
        text = shakespeare(max_chars=chars)
        vocab = sorted(set(text))
        self.vocab = len(vocab)
        lookup = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
        cut = int(len(ids) * 0.9)
        n_train = (cut - 1) // self.seq
        self.train_x = ids[: n_train * self.seq].reshape(n_train, self.seq)
        self.train_y = ids[1 : n_train * self.seq + 1].reshape(n_train, self.seq)
        n_test = (len(ids) - cut - 1) // self.seq
        self.test_x = ids[cut : cut + n_test * self.seq].reshape(n_test, self.seq)
        self.test_y = ids[cut + 1 : cut + n_test * self.seq + 1].reshape(n_test, self.seq)

    @classmethod
    def check_data(cls) -> None:
        shakespeare_archive()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return CharLSTM(self.vocab)

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1.0, momentum=self.momentum if momentum else 0.0)

    def steps_per_epoch(self) -> int:
        return self.train_x.shape[0] // self.world // self.batch

    def batches(self, epoch: int) -> Iterator[tuple[Any, torch.Tensor]]:
        idx = self.shard(self.train_x.shape[0], epoch)
        for s in range(self.steps_per_epoch()):
            b = idx[s * self.batch : (s + 1) * self.batch]
            yield self.train_x[b], self.train_y[b]

    def loss(self, model: torch.nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        out = model(inputs)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def clip(self, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.finish_evaluation(self.evaluate_part(model, 0, 1))

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> dict[str, float]:
        cut = self.test_slice(self.test_x.shape[0], part, parts)
        xs, ys = self.test_x[cut], self.test_y[cut]
        total, count = 0.0, 0
        for lo in range(0, xs.shape[0], 256):
            x, y = xs[lo : lo + 256], ys[lo : lo + 256]
            out = model(x)
            total += float(
                F.cross_entropy(out.reshape(-1, self.vocab), y.reshape(-1), reduction="sum")
            )
            count += y.numel()
        return {"loss": total, "count": float(count)}

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / sums["count"]
        return {"perplexity": math.exp(loss), "test_loss": loss}
