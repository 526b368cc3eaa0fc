"""The sizing checks behind the time-to-accuracy recipes (docs/training.md, issue 30).

Prints, on one process and one thread (run it on a quiet machine):

* ``wordlm``: the vocabulary's coverage of the plays' tokens, the parameter count
  and the share of the embedding and the softmax; test perplexity after 400 steps
  of 40 sequences at learning rates 1, 5 and 20 (the choice of 20);
* ``newsgroups``: test accuracy after one epoch (batch 32, as P = 2 x 16) with
  2^20 and 2^22 hash buckets;
* the local passes of a ``topk`` step over the ``wordlm`` gradient: one
  read-modify-write pass over its floats, and the selectors' time for 1%.

    .venv/bin/python benchmarks/recipe_checks.py
"""

from __future__ import annotations

import os
import time

import torch

from sparcml.compress import get
from sparcml.tools.recipes.newsgroups import Newsgroups
from sparcml.tools.recipes.wordlm import WordLM


def _wordlm() -> int:
    r = WordLM(0, 1, 0)
    model = r.model()
    n = sum(p.numel() for p in model.parameters())
    big = model.embed.weight.numel() + model.out.weight.numel() + model.out.bias.numel()
    print(
        f"wordlm: {r.train_x.numel() + r.test_x.numel():,} tokens in sequences, vocabulary "
        f"{r.vocab_size:,} covers {100 * (1 - r.unknown):.1f}% of the tokens; {n:,} parameters, "
        f"{100 * big / n:.1f}% in the embedding and the softmax"
    )
    for lr in (1.0, 5.0, 20.0):
        r = WordLM(0, 1, 0, lr=lr)
        r.batch = 40
        m = r.model()
        opt = r.optimizer(m.parameters())
        it = r.batches(0)
        t0 = time.perf_counter()
        for _ in range(400):
            x, y = next(it)
            loss = r.loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            r.clip(m)
            opt.step()
        ppl = r.finish_evaluation(r.evaluate_part(m, 0, 8))["perplexity"]
        print(
            f"wordlm lr {lr:g}: test perplexity {ppl:.1f} after 400 steps of 40 sequences "
            f"(first eighth of the test set; {time.perf_counter() - t0:.1f} s)"
        )
    return n


def _newsgroups() -> None:
    for features in (1 << 20, 1 << 22):
        r = Newsgroups(0, 1, 0, features=features)
        r.batch = 32
        m = r.model()
        opt = r.optimizer(m.parameters())
        for x, y in r.batches(0):
            loss = r.loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        acc = r.evaluate(m)["accuracy"]
        print(f"newsgroups 2^{features.bit_length() - 1} buckets: test accuracy "
              f"{100 * acc:.2f}% after one epoch ({r.steps_per_epoch()} steps of 32)")  # fmt: skip


def _passes(n: int) -> None:
    x, g = torch.randn(n), torch.randn(n)
    for _ in range(3):
        (x * 0.9).add_(g)
    t0 = time.perf_counter()
    for _ in range(50):
        (x * 0.9).add_(g)
    ms = (time.perf_counter() - t0) / 50 * 1e3
    print(f"one read-modify-write pass over {n:,} floats: {ms:.2f} ms "
          f"({3 * 4 * n / ms / 1e6:.1f} GB/s)")  # fmt: skip
    for name in ("topk", "trimmed_topk", "threshold_reuse"):
        sel = get(name, density=0.01)
        for _ in range(3):
            sel.select(x)
        t0 = time.perf_counter()
        for _ in range(20):
            s = sel.select(x)
        ms = (time.perf_counter() - t0) / 20 * 1e3
        print(f"selector {name}: {ms:.2f} ms for 1% of {n:,} ({s.nnz:,} selected)")


def main() -> None:
    torch.set_num_threads(1)
    print(
        f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; torch {torch.__version__}"
    )
    n = _wordlm()
    _newsgroups()
    _passes(n)


if __name__ == "__main__":
    main()
