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

import re
from collections import Counter
from typing import Any

import torch

from .data import shakespeare, shakespeare_archive
from .language import LanguageRecipe, LSTMModel

__all__ = ["WordLM", "tokenize"]

#: a word (letters with an optional apostrophe part: "o'er", "king's") or one
#: punctuation character, after lower-casing
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|[^\sa-z]")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, in order."""
    return _TOKEN.findall(text.lower())


class WordLM(LanguageRecipe):
    """Word-level LSTM language model, 10,000-word vocabulary, perplexity per word.

    Options: ``limit`` (training sequences of 35 words), ``vocab`` (default
    10,000), ``width`` (embedding and state, default 64).
    """

    name = "wordlm"
    epochs = 1
    methods = ("dense", "topk", "natural", "oktopk", "redsync")
    seq = 35
    batch = 20
    vocab_size = 10_000
    width = 64
    lr = 20.0
    momentum = 0.0
    options_taken = ("vocab", "width", "lr")
    clip_norm = 0.25
    eval_batch = 200

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
        self.split(ids, options.get("limit"))
        self.unknown = float((ids == 0).float().mean())

    @classmethod
    def check_data(cls) -> None:
        shakespeare_archive()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        # uniform(-0.1, 0.1) embedding and softmax, as PyTorch's word_language_model
        return LSTMModel(self.vocab_size, self.width, self.width, init_range=0.1)

    def optimizer(self, params: Any, momentum: bool = True) -> torch.optim.Optimizer:
        # vanilla SGD as in RedSync's LSTM runs: the optimizer has no momentum either way
        return torch.optim.SGD(params, lr=self.lr)

    def clip(self, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)
