"""What the language-model recipes share: token sequences, next-token loss, perplexity."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .base import Recipe

__all__ = ["LSTMModel", "LanguageRecipe"]


class LSTMModel(torch.nn.Module):
    """Embedding -> one LSTM layer -> a linear layer over the vocabulary (no weight
    tying). ``init_range``: the embedding and output weights uniform in
    ``[-init_range, init_range]`` and the output bias zero (PyTorch's
    word_language_model example); None: PyTorch's default initialisation."""

    def __init__(
        self, vocab: int, embed: int, hidden: int, init_range: float | None = None
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.lstm = torch.nn.LSTM(embed, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)
        if init_range is not None:
            torch.nn.init.uniform_(self.embed.weight, -init_range, init_range)
            torch.nn.init.uniform_(self.out.weight, -init_range, init_range)
            torch.nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h)


class LanguageRecipe(Recipe):
    """Next-token prediction over a token stream cut into sequences of ``seq``.

    A subclass calls :meth:`split` with the whole stream; the last 10% of it is
    held out. The metric is test perplexity per token (lower is better).
    """

    metric = "perplexity"
    higher_is_better = False
    seq = 64
    batch = 16
    #: sequences per forward pass when evaluating
    eval_batch = 256

    def split(self, ids: torch.Tensor, limit: int | None = None) -> None:
        """Training and test sequences (inputs and next-token targets) from ``ids``;
        ``limit``: at most that many training sequences."""
        cut = int(len(ids) * 0.9)
        n_train = (cut - 1) // self.seq
        if limit:
            n_train = min(n_train, int(limit))
        self.train_x = ids[: n_train * self.seq].reshape(n_train, self.seq)
        self.train_y = ids[1 : n_train * self.seq + 1].reshape(n_train, self.seq)
        n_test = (len(ids) - cut - 1) // self.seq
        self.test_x = ids[cut : cut + n_test * self.seq].reshape(n_test, self.seq)
        self.test_y = ids[cut + 1 : cut + n_test * self.seq + 1].reshape(n_test, self.seq)

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

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.finish_evaluation(self.evaluate_part(model, 0, 1))

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> dict[str, float]:
        cut = self.test_slice(self.test_x.shape[0], part, parts)
        xs, ys = self.test_x[cut], self.test_y[cut]
        total, count = 0.0, 0
        for lo in range(0, xs.shape[0], self.eval_batch):
            x, y = self.on_device((xs[lo : lo + self.eval_batch], ys[lo : lo + self.eval_batch]))
            out = model(x)
            total += float(
                F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
            )
            count += y.numel()
        return {"loss": total, "count": float(count)}

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / max(sums["count"], 1.0)
        return {"perplexity": math.exp(min(loss, 50.0)), "test_loss": loss}
