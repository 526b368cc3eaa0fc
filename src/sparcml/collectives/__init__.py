"""Sparse collectives, one algorithm per module, looked up by name in a registry.

Importing this package registers every built-in algorithm.
"""

from __future__ import annotations

from .allreduce import check_consistent, choose_algorithm, sparse_allreduce
from .dense import dense_allreduce
from .dsar_split_allgather import dsar_split_allgather
from .registry import algorithms, get_algorithm, register
from .sparse_allgather import sparse_allgather
from .ssar_recursive_double import ssar_recursive_double
from .ssar_split_allgather import ssar_split_allgather

__all__ = [
    "algorithms",
    "check_consistent",
    "choose_algorithm",
    "dense_allreduce",
    "dsar_split_allgather",
    "get_algorithm",
    "register",
    "sparse_allgather",
    "sparse_allreduce",
    "ssar_recursive_double",
    "ssar_split_allgather",
]
