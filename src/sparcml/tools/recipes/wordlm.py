"""Word-level language modelling on Shakespeare's plays: RedSync's PTB/WikiText-2 setting.

RedSync (paper 002, sec. 4 and Table 1) gains most on LSTM language models
whose embedding and softmax layers hold most of the parameters: their
gradients are large next to the compute of a step, so communication dominates.
This recipe is that shape on text a package ships: a vocabulary of the 10,000
most frequent words of the plays (the rest mapped to ``<unk>``), an embedding,
one LSTM layer and a softmax over the vocabulary. With the default 64-wide
embedding and state, 96% of the 1.33 M parameters are in the embedding and the
softmax (RedSync's medium PTB model is 1500 wide: the shape is the same, the
compute smaller, sized so that dense fp32 at 100 Mbit/s trains in minutes).

Training follows the PTB recipes RedSync uses: truncated back-propagation over
35 words, vanilla SGD with gradient clipping (RedSync sec. 4), learning rate 20
and clipping at norm 0.25 as in PyTorch's word_language_model example (rate 1
and 5 trained slower: test perplexity 567 and 463 after 400 steps of 40
sequences, against 255 at rate 20). Each sequence starts from a zero state (the batches are shuffled
across ranks, so carrying state between them would mix streams). The last 10%
of the words are held out; the metric is test perplexity per word.

Beyond RedSync: the embedding's gradient is non-zero only on the rows of the
words a batch contains, so ``--layers 'embed.*=nonzeros'`` sums those rows
exactly (SparCML's sparse gradients) while the rest uses the chosen method.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .base import Recipe
from .data import shakespeare, shakespeare_archive

__all__ = ["WordLM", "WordLSTM", "tokenize"]

#: a word (letters with an optional apostrophe part: "o'er", "king's") or one
#: punctuation character, after lower-casing
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|[^\sa-z]")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, in order."""
    return _TOKEN.findall(text.lower())


class WordLSTM(torch.nn.Module):
    """Embedding -> one LSTM layer -> softmax over the vocabulary (no weight tying)."""

    def __init__(self, vocab: int, embed: int = 64, hidden: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.lstm = torch.nn.LSTM(embed, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)
        # PyTorch's word_language_model example: uniform(-0.1, 0.1) embedding and softmax
        torch.nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        torch.nn.init.uniform_(self.out.weight, -0.1, 0.1)
        torch.nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h)


class WordLM(Recipe):
    """Word-level LSTM language model, 10,000-word vocabulary, perplexity per word.

    Options: ``limit`` (training sequences of 35 words), ``vocab`` (default
    10,000), ``width`` (embedding and state, default 64).
    """

    name = "wordlm"
    epochs = 1
    methods = ("dense", "topk", "natural", "oktopk", "redsync")
    metric = "perplexity"
    higher_is_better = False
    seq = 35
    batch = 20
    vocab_size = 10_000
    width = 64
    lr = 20.0
    momentum = 0.0
    options_taken = ("vocab", "width", "lr")
    clip_norm = 0.25

    def __init__(self, rank: int, world: int, seed: int = 0, **options: Any) -> None:
        super().__init__(rank, world, seed, **options)
        self.vocab_size = int(options.get("vocab") or self.vocab_size)
        self.width = int(options.get("width") or self.width)
        self.lr = float(options.get("lr") or self.lr)
        words = tokenize(shakespeare())
        counts = Counter(words)
        # index 0 is <unk>; the most frequent words next, ties broken by the word
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.vocab_size - 1]
        lookup = {w: i + 1 for i, (w, _) in enumerate(ranked)}
        ids = torch.tensor([lookup.get(w, 0) for w in words], dtype=torch.int64)
        cut = int(len(ids) * 0.9)
        n_train = (cut - 1) // self.seq
        limit = options.get("limit")
        if limit:
            n_train = min(n_train, int(limit))
        self.train_x = ids[: n_train * self.seq].reshape(n_train, self.seq)
        self.train_y = ids[1 : n_train * self.seq + 1].reshape(n_train, self.seq)
        n_test = (len(ids) - cut - 1) // self.seq
        self.test_x = ids[cut : cut + n_test * self.seq].reshape(n_test, self.seq)
        self.test_y = ids[cut + 1 : cut + n_test * self.seq + 1].reshape(n_test, self.seq)
        self.unknown = float((ids == 0).float().mean())

    @classmethod
    def check_data(cls) -> None:
        shakespeare_archive()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return WordLSTM(self.vocab_size, self.width, self.width)

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        # vanilla SGD as in RedSync's LSTM runs: the optimizer has no momentum either way
        return torch.optim.SGD(params, lr=self.lr)

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
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.finish_evaluation(self.evaluate_part(model, 0, 1))

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> dict[str, float]:
        cut = self.test_slice(self.test_x.shape[0], part, parts)
        xs, ys = self.test_x[cut], self.test_y[cut]
        total, count = 0.0, 0
        for lo in range(0, xs.shape[0], 200):
            x, y = xs[lo : lo + 200], ys[lo : lo + 200]
            out = model(x)
            total += float(
                F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
            )
            count += y.numel()
        return {"loss": total, "count": float(count)}

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / max(sums["count"], 1.0)
        return {"perplexity": math.exp(min(loss, 50.0)), "test_loss": loss}
