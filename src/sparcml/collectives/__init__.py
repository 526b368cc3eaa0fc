"""Sparse collectives, one algorithm per module, looked up by name in a registry.

Importing this package imports every module in it, so every algorithm registers
itself: adding a collective is adding one file (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from ._common import split_and_reduce
from .allreduce import check_consistent, choose_algorithm, sparse_allreduce
from .dense import dense_allreduce
from .dsar_split_allgather import dsar_split_allgather
from .gaussiank_allgather import gaussiank
from .gtopk import gtopk
from .oktopk import OkTopkResult, OkTopkState, oktopk, oktopk_allreduce
from .registry import algorithms, get_algorithm, register
from .sparse_allgather import sparse_allgather
from .ssar_recursive_double import ssar_recursive_double
from .ssar_split_allgather import ssar_split_allgather
from .topka import topka
from .topkdsa import topkdsa

__all__ = [
    "OkTopkResult",
    "OkTopkState",
    "algorithms",
    "check_consistent",
    "choose_algorithm",
    "dense_allreduce",
    "dsar_split_allgather",
    "gaussiank",
    "get_algorithm",
    "gtopk",
    "oktopk",
    "oktopk_allreduce",
    "register",
    "sparse_allgather",
    "sparse_allreduce",
    "split_and_reduce",
    "ssar_recursive_double",
    "ssar_split_allgather",
    "topka",
    "topkdsa",
]

# Every module of the package: a new algorithm file registers itself on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
