"""Training methods, one module each, registered with every fact about them.

See :mod:`.base` for the registry; :func:`methods` lists the names. Every module
of this package is imported here, so a new method is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    MethodConfig,
    MethodResult,
    MethodSpec,
    config_of,
    method_kind,
    method_spec,
    methods,
    register_method,
)
from .dense import Dense
from .half import Bf16, Fp16
from .natural_ina import NaturalIna
from .oktopk import OkTopk
from .quantized import Quantized
from .redsync import RedSync
from .sparse import Nonzeros, TopK, valid_algorithms

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Bf16",
    "Dense",
    "Fp16",
    "MethodConfig",
    "MethodResult",
    "MethodSpec",
    "NaturalIna",
    "Nonzeros",
    "OkTopk",
    "Quantized",
    "RedSync",
    "TopK",
    "config_of",
    "method_kind",
    "method_spec",
    "methods",
    "register_method",
    "valid_algorithms",
]
