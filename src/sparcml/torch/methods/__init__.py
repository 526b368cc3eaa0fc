"""Training methods, one module each, registered with every fact about them.

See :mod:`.base` for the registry; :func:`methods` lists the names.
"""

from __future__ import annotations

from . import dense, half, natural_ina, oktopk, quantized, redsync, sparse
from .base import MethodConfig, MethodSpec, method_kind, method_spec, methods, register_method
from .sparse import valid_algorithms

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "dense",
    "half",
    "method_kind",
    "method_spec",
    "methods",
    "natural_ina",
    "oktopk",
    "quantized",
    "redsync",
    "register_method",
    "sparse",
    "valid_algorithms",
]
