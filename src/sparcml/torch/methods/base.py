"""The training-method registry: one module per method, registered with every fact.

A method is what the per-bucket pipeline (:mod:`sparcml.torch.reduce`, step 5)
runs on the accumulated gradient ``acc``: ``run(state, bucket, acc) -> (sent,
total)``, where ``sent`` is what this rank sent (dense or a stream over ``acc``;
None when nothing is fed back) and ``total`` the flat sum over ranks. A
registration carries:

* ``kind``: the method's key (``"dense"``, ``"sparse"``, ...);
* ``names``: the method names that select it; ``None`` for the compressor-based
  kinds, which match :mod:`sparcml.compress` names instead (``"sparse"``: a
  selector or ``selector+quantizer``; ``"quantized"``: a quantizer alone);
* ``config``: a dataclass of the method's own hyperparameters (typed, with
  defaults and a ``validate(method)``); :class:`~sparcml.torch.SparcmlState`
  routes its keyword arguments to it by field name;
* ``unbiased``: sends every entry (no error feedback, no momentum correction);
* ``operator``: builds a compressor per bucket from the method name;
* ``checks_nonfinite``: its collective refuses NaN/Inf on every rank (one
  :class:`~sparcml.errors.NonFiniteError` everywhere, from the header exchange
  every call makes anyway) before anything changes state, so
  ``nan_policy="propagate"`` needs no round of its own to agree on a NaN;
* ``carries_nonfinite``: NaN/Inf travel through its collective as through a
  dense allreduce (a cast), so ``nan_policy="propagate"`` needs no check at all;
* ``averages``: ``run`` returns the average itself (it divides before the
  collective, as PyTorch's 16-bit hooks do to keep the 16-bit sum in range), so
  the pipeline does not divide again;
* ``lossless``: its average is exact (``dense``, ``nonzeros``): under a state
  with DGC momentum correction (a layer rule's lossless method), the momentum is
  applied after the exact average, ``u = m u + avg(g)``, the same update as
  momentum before it, without densifying what is sent (beyond the papers: DGC
  corrects momentum for what sparsification delays, and nothing is delayed here);
* ``description``: one line for ``sparcml methods``.

Adding a method: one module here with its config, its run function and
``register_method(...)``, imported in ``methods/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...compress.base import available
from ...stream import SparseStream

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "RunFn",
    "all_options",
    "method_kind",
    "method_spec",
    "methods",
    "register_method",
]

RunFn = Callable[
    ["SparcmlState", "Bucket", torch.Tensor],
    tuple[torch.Tensor | SparseStream | None, torch.Tensor],
]


@dataclasses.dataclass
class MethodConfig:
    """Base of the methods' hyperparameter dataclasses."""

    def validate(self, method: str) -> None:
        """Raise ``ValueError`` naming a bad value (called once, at construction)."""

    def settings(self) -> dict[str, Any]:
        """The values every rank must share (compared at registration)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: repr(x) for k, x in sorted(v.items())}
    if isinstance(v, (bytes, bytearray)):
        return None  # secrets never travel
    return v


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Every fact about one training method (see the module docstring)."""

    kind: str
    description: str
    run: RunFn
    config: type[MethodConfig] = MethodConfig
    names: tuple[str, ...] | None = None
    unbiased: bool = False
    operator: bool = False
    checks_nonfinite: bool = False
    carries_nonfinite: bool = False
    averages: bool = False
    lossless: bool = False


_METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry (by its ``kind``)."""
    if spec.kind in _METHODS and _METHODS[spec.kind] is not spec:
        raise ValueError(f"a training method of kind {spec.kind!r} is already registered")
    _METHODS[spec.kind] = spec
    return spec


def all_options() -> dict[str, list[str]]:
    """Every method option name and the method kinds that take it."""
    out: dict[str, list[str]] = {}
    for spec in _METHODS.values():
        for f in dataclasses.fields(spec.config):
            out.setdefault(f.name, []).append(spec.kind)
    return out


def method_spec(kind: str) -> MethodSpec:
    """The registration of a method kind."""
    return _METHODS[kind]


def method_kind(method: str) -> str:
    """The kind a method name selects: a named method, ``"sparse"`` (a selector,
    maybe ``+quantizer``) or ``"quantized"`` (a value quantizer alone).

    Raises:
        ValueError: no method of that name.
    """
    for spec in _METHODS.values():
        if spec.names is not None and method in spec.names:
            return spec.kind
    kinds = available()
    parts = method.split("+")
    if len(parts) == 1 and kinds.get(method) == "selector":
        return "sparse"
    if len(parts) == 1 and kinds.get(method) == "quantizer":
        return "quantized"
    if len(parts) == 2 and kinds.get(parts[0]) == "selector" and kinds.get(parts[1]) == "quantizer":
        return "sparse"
    raise ValueError(
        f"unknown method {method!r}; use one of {', '.join(sorted(methods()))} "
        "or a 'selector+quantizer' composition such as 'topk+natural'"
    )


def methods() -> dict[str, str]:
    """Every method name with a one-line description.

    Besides these, any selector (``topk``, ``randomk``, ...) or ``selector+quantizer``
    composition (``topk+natural``) of :mod:`sparcml.compress` is a method.
    """
    out: dict[str, str] = {}
    for spec in _METHODS.values():
        for name in spec.names or ():
            out[name] = spec.description
    for name, kind in available().items():
        if kind == "selector":
            out[name] = f"sparse: {name} selection + error feedback + sparse allreduce"
        elif kind == "quantizer":
            out[name] = f"dense: {name} quantization in DSAR's quantized allreduce"
    return out
