"""Name -> algorithm registry of the sparse allreduce (``algorithm=`` of :func:`sparse_allreduce`).

An algorithm is ``fn(stream, comm, codec) -> SparseStream`` written SPMD style against
the :class:`~sparcml.comm.Communicator` interface. New algorithms register
themselves with ``@register("name")``; nothing else needs to change.

``exact=False`` marks the top-k family (``gtopk``, ``gaussiank``, ``oktopk``):
their result is by design not the sum of the inputs, so generic checks against
a dense sum (the demo, the property tests) list only ``algorithms(exact=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ..stream import SparseStream

__all__ = ["Algorithm", "algorithms", "check_options", "get_algorithm", "register"]

Algorithm = Callable[..., "SparseStream"]
F = TypeVar("F", bound=Callable[..., "SparseStream"])

_REGISTRY: dict[str, Algorithm] = {}
_INEXACT: set[str] = set()


def register(name: str, exact: bool = True) -> Callable[[F], F]:
    """Decorator adding an allreduce algorithm to the registry under ``name``.

    Args:
        name: the ``algorithm=`` name.
        exact: whether the result is the sum of the ranks' inputs.
    """

    def deco(fn: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
        _REGISTRY[name] = fn
        if not exact:
            _INEXACT.add(name)
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


def check_options(fn: Algorithm, name: str, options: dict[str, object]) -> None:
    """Raise a clear error for options the algorithm does not take."""
    import inspect

    params = inspect.signature(fn).parameters
    takes = [p for p in params if p not in ("stream", "comm", "codec")]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        hint = f"it takes {', '.join(takes)}" if takes else "it takes no options"
        raise ValueError(f"algorithm {name!r} has no option(s) {', '.join(unknown)}; {hint}")


def algorithms(exact: bool | None = None) -> list[str]:
    """Names of the registered algorithms, sorted.

    Args:
        exact: True for those whose result is the sum of the inputs, False for the
            top-k family, None for all.
    """
    return sorted(n for n in _REGISTRY if exact is None or (n not in _INEXACT) == exact)
