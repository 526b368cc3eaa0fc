"""Logistic regression on hashed word n-grams of 20 Newsgroups (SparCML's Table 2 setting).

Features: unigrams and bigrams hashed into ``2^22`` buckets, each document's
counts scaled to unit L2 norm. Task: science and technology groups (``comp.*``,
``sci.*``) against the rest. The model is one weight per bucket plus a bias, so
a batch's gradient is non-zero only on the buckets its documents contain: the
``nonzeros`` method sums exactly those, losslessly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .base import Recipe
from .data import newsgroups, newsgroups_archive

FEATURES = 1 << 22


def _hash_docs(
    texts: list[str], vocab: dict[str, int], features: int = FEATURES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bags of hashed uni/bigrams: (feature ids, weights, offsets) for EmbeddingBag."""
    ids_list, weights_list, offsets = [], [], [0]
    a, b = 2654435761, 40503
    for text in texts:
        tok = torch.tensor(
            [vocab.setdefault(w, len(vocab)) for w in text.split()], dtype=torch.int64
        )
        uni = (tok * a) % features
        bi = (tok[:-1] * a + tok[1:] * b + 1) % features
        feats, counts = torch.unique(torch.cat([uni, bi]), return_counts=True)
        w = counts.double()
        w = (w / w.norm()).float() if w.numel() else w.float()
        ids_list.append(feats)
        weights_list.append(w)
        offsets.append(offsets[-1] + feats.numel())
    return torch.cat(ids_list), torch.cat(weights_list), torch.tensor(offsets[:-1])


class _Bags:
    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> None:
        self.ids, self.weights = ids, weights
        self.starts = offsets
        self.ends = torch.cat([offsets[1:], torch.tensor([ids.numel()])])

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lens = self.ends[rows] - self.starts[rows]
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
        idx = torch.repeat_interleave(self.starts[rows] - offs, lens) + torch.arange(
            int(lens.sum())
        )
        return self.ids[idx], self.weights[idx], offs


def _flag(value: Any, name: str) -> bool:
    """A 0/1 recipe option (``--recipe-option sparse=1``)."""
    if value in (0, 1, "0", "1", True, False):
        return bool(int(value))
    raise ValueError(f"newsgroups option {name} takes 0 or 1, got {value!r}")


class LogReg(torch.nn.Module):
    def __init__(self, features: int = FEATURES, sparse: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.EmbeddingBag(features, 1, mode="sum", sparse=sparse)
        torch.nn.init.zeros_(self.w.weight)
        self.b = torch.nn.Parameter(torch.zeros(1))

    def forward(self, bags: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, weights, offsets = bags
        return self.w(ids, offsets, per_sample_weights=weights).squeeze(1) + self.b


class Newsgroups(Recipe):
    """Binary logistic regression, 4.2 M features (option ``features``: another
    number of hash buckets), plain SGD.

    Option ``sparse=1``: the weights' gradient is a sparse COO tensor
    (``EmbeddingBag(sparse=True)``), the rows a batch touches: backward writes no
    dense gradient, DDP's own allreduce sums it sparsely (gloo's sparse
    allreduce), and sparcml's ``nonzeros`` and ``dense`` reduce it as a sparse
    stream (SparCML sec. 8.2's setting). PyTorch's compression hooks (fp16, bf16,
    PowerSGD) take dense buckets only: refused with it."""

    name = "newsgroups"
    epochs = 4
    methods = ("dense", "nonzeros")
    metric = "accuracy"
    batch = 16
    lr = 4.0
    momentum = 0.0
    options_taken = ("features", "sparse")

    def __init__(self, rank: int, world: int, seed: int = 0, **options: Any) -> None:
        super().__init__(rank, world, seed, **options)
        data = newsgroups()
        vocab: dict[str, int] = {}
        limit = options.get("limit")
        self.features = int(options.get("features") or FEATURES)
        self.sparse = _flag(options.get("sparse", 0), "sparse")
        train = data["train"]
        if limit and limit < len(train):
            # the file is sorted by newsgroup: a uniform subset, the same in every run
            # (its first documents alone are four groups, 77% of one label)
            pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
            train = [train[i] for i in pick[: int(limit)].sort().values.tolist()]
        self.train = _Bags(*_hash_docs([t for _, t in train], vocab, self.features))
        self.train_y = torch.tensor([_label(c) for c, _ in train])
        self.test = _Bags(*_hash_docs([t for _, t in data["test"]], vocab, self.features))
        self.test_y = torch.tensor([_label(c) for c, _ in data["test"]])

    @classmethod
    def check_data(cls) -> None:
        newsgroups_archive()

    @classmethod
    def check_methods(cls, methods: list[str], options: dict[str, Any]) -> None:
        from ...torch.methods import method_spec
        from ...torch.peers import is_peer

        if _flag(options.get("sparse", 0), "sparse"):
            dense_only = [
                m
                for m in methods
                if (m != "ddp" if is_peer(m) else not method_spec(m).sparse_gradients)
            ]
            if dense_only:
                raise ValueError(
                    f"newsgroups with sparse=1: {', '.join(dense_only)} take dense gradients "
                    "only; compare ddp (PyTorch's sparse allreduce) with dense, nonzeros, "
                    "topk or topk+natural, or drop sparse=1"
                )

    def model(self) -> torch.nn.Module:
        return LogReg(self.features, self.sparse)

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)

    def steps_per_epoch(self) -> int:
        return self.train_y.numel() // self.world // self.batch

    def batches(self, epoch: int) -> Iterator[tuple[Any, torch.Tensor]]:
        idx = self.shard(self.train_y.numel(), epoch)
        for s in range(self.steps_per_epoch()):
            rows = idx[s * self.batch : (s + 1) * self.batch]
            yield self.train.take(rows), self.train_y[rows]

    def loss(self, model: torch.nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(inputs), target)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.finish_evaluation(self.evaluate_part(model, 0, 1))

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> dict[str, float]:
        cut = self.test_slice(self.test_y.numel(), part, parts)
        rows = torch.arange(self.test_y.numel())[cut]
        y = self.on_device(self.test_y[rows])
        logits = model(self.on_device(self.test.take(rows)))
        loss = float(F.binary_cross_entropy_with_logits(logits, y, reduction="sum"))
        correct = float(((logits > 0).float() == y).sum())
        return {"correct": correct, "loss": loss, "count": float(rows.numel())}

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        return {"accuracy": sums["correct"] / n, "test_loss": sums["loss"] / n}


def _label(category: str) -> float:
    return 1.0 if category.startswith(("comp.", "sci.")) else 0.0
