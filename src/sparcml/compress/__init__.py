"""Compression operators: pure tensor code, no communication, CPU and CUDA tensors.

``sparcml.compress.get(name, **params)`` builds an operator; ``"a+b"`` composes a
selector with a value quantizer. See :mod:`.base` for the contract.

Selectors: ``topk``, ``randomk``, ``blocktopk``, ``trimmed_topk``,
``threshold_bsearch``, ``sampled_threshold_bsearch``, ``threshold_reuse``,
``gaussiank``. Quantizers: ``qsgd``, ``natural``, ``dithering``,
``natural_dithering``. Operator: ``asq`` (selects and quantizes).
"""

from __future__ import annotations

from . import (
    asq,
    blocktopk,
    dithering,
    gaussiank,
    natural,
    qsgd,
    randomk,
    threshold_bsearch,
    threshold_reuse,
    topk,
    trimmed_topk,
)
from .asq import ASQ
from .base import Composed, Compressor, Context, Quantizer, Selector, available, get, register
from .blocktopk import BlockTopK
from .dithering import Dithering, NaturalDithering
from .gaussiank import GaussianK
from .natural import NaturalCompression
from .qsgd import QSGD
from .randomk import RandomK
from .threshold_bsearch import SampledThresholdBinarySearch, ThresholdBinarySearch
from .threshold_reuse import ThresholdReuse
from .topk import TopK
from .trimmed_topk import TrimmedTopK

del asq, blocktopk, dithering, gaussiank, natural, qsgd, randomk
del threshold_bsearch, threshold_reuse, topk, trimmed_topk

__all__ = [
    "ASQ",
    "QSGD",
    "BlockTopK",
    "Composed",
    "Compressor",
    "Context",
    "Dithering",
    "GaussianK",
    "NaturalCompression",
    "NaturalDithering",
    "Quantizer",
    "RandomK",
    "SampledThresholdBinarySearch",
    "Selector",
    "ThresholdBinarySearch",
    "ThresholdReuse",
    "TopK",
    "TrimmedTopK",
    "available",
    "get",
    "register",
]
