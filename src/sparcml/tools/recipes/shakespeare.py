"""Character-level language modelling on Shakespeare's plays with an LSTM."""

from __future__ import annotations

import math
from typing import Any

import torch

from .data import shakespeare, shakespeare_archive
from .language import LanguageRecipe, LSTMModel


class Shakespeare(LanguageRecipe):
    """One-layer LSTM (256 units) over characters; SGD (lr 1, momentum 0.9) with
    gradient clipping at norm 1 (RedSync trains its LSTMs with vanilla SGD and
    clipping, sec. 4); the last 10% of the text held out.

    Reported metric: test perplexity per character (lower is better).
    """

    name = "shakespeare"
    epochs = 3
    methods = ("dense", "topk", "natural", "oktopk", "redsync")
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
        self.split(torch.tensor([lookup[c] for c in text], dtype=torch.int64))

    @classmethod
    def check_data(cls) -> None:
        shakespeare_archive()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return LSTMModel(self.vocab, 64, 256)  # embedding 64, 256 units

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1.0, momentum=self.momentum if momentum else 0.0)

    def clip(self, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
