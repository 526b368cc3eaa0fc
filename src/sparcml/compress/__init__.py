"""Compression operators: pure tensor code, no communication, CPU and CUDA tensors.

``sparcml.compress.get(name, **params)`` builds an operator; ``"a+b"`` composes a
selector with a value quantizer. See :mod:`.base` for the contract.

Selectors: ``topk``, ``randomk``, ``blocktopk``, ``trimmed_topk``,
``threshold_bsearch``, ``sampled_threshold_bsearch``, ``threshold_reuse``,
``gaussiank``. Quantizers: ``qsgd``, ``natural``, ``dithering``,
``natural_dithering``. Operator: ``asq`` (selects and quantizes). Each class lives
in its module (``sparcml.compress.topk.TopK``, ...); importing this package imports
every module in it, so every operator registers itself: a new one is one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Composed, Compressor, Context, Quantizer, Selector, available, get, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Composed",
    "Compressor",
    "Context",
    "Quantizer",
    "Selector",
    "available",
    "get",
    "register",
]
