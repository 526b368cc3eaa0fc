"""Name -> algorithm registry of the sparse allreduce (``algorithm=`` of :func:`sparse_allreduce`).

An algorithm is ``fn(stream, comm, codec) -> SparseStream`` written SPMD style against
the :class:`~sparcml.comm.Communicator` interface. New algorithms register
themselves with ``@register("name")``; nothing else needs to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ..stream import SparseStream

__all__ = ["Algorithm", "algorithms", "get_algorithm", "register"]

Algorithm = Callable[..., "SparseStream"]
F = TypeVar("F", bound=Callable[..., "SparseStream"])

_REGISTRY: dict[str, Algorithm] = {}


def register(name: str) -> Callable[[F], F]:
    """Decorator adding an allreduce algorithm to the registry under ``name``."""

    def deco(fn: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown allreduce algorithm {name!r}; known: auto, {known}") from None


def algorithms() -> list[str]:
    """Names of the registered algorithms, sorted."""
    return sorted(_REGISTRY)
