"""Training recipes on real data that packages ship (see :mod:`.data`).

``sparcml train fmnist|shakespeare|newsgroups|wordlm --methods dense,topk,...`` trains
each method on local gloo ranks with DDP and the sparcml hook, and writes a
results table and loss/accuracy plots (docs/training.md has the figures).
"""

from __future__ import annotations

from .base import Recipe
from .fmnist import FashionMNIST
from .newsgroups import Newsgroups
from .shakespeare import Shakespeare
from .wordlm import WordLM

RECIPES: dict[str, type[Recipe]] = {
    "fmnist": FashionMNIST,
    "shakespeare": Shakespeare,
    "newsgroups": Newsgroups,
    "wordlm": WordLM,
}

__all__ = ["RECIPES", "FashionMNIST", "Newsgroups", "Recipe", "Shakespeare", "WordLM"]
