"""Sparse collectives, one algorithm per module, looked up by name in a registry.

Importing this package imports every module in it, so every algorithm registers
itself: adding a collective is adding one file (see docs/ARCHITECTURE.md). Each
algorithm's function lives in its module (``sparcml.collectives.ssar_recursive_double
.ssar_recursive_double``, ...); users call it by name through
``sparse_allreduce(algorithm=...)``.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._common import split_and_reduce
from .allreduce import sparse_allreduce
from .autotune import choose_algorithm
from .oktopk import OkTopkResult, OkTopkState, oktopk_allreduce
from .reduce_scatter import reduce_scatter
from .registry import algorithms, get_algorithm, register
from .sparse_allgather import sparse_allgather

__all__ = [
    "OkTopkResult",
    "OkTopkState",
    "algorithms",
    "choose_algorithm",
    "get_algorithm",
    "oktopk_allreduce",
    "reduce_scatter",
    "register",
    "sparse_allgather",
    "sparse_allreduce",
    "split_and_reduce",
]

# Every module of the package: a new algorithm file registers itself on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
