"""The training-method registry: one module per method, registered with every fact.

A method is what the per-group pipeline (:mod:`sparcml.torch.reduce`, step 5)
runs on the accumulated gradient ``acc``: ``run(group, bucket, acc) ->
MethodResult(sent, total)``, where ``sent`` is what this rank sent (dense or a
stream over ``acc``; None when nothing is fed back) and ``total`` the sum over
ranks (flat, or a stream over the bucket, which step 7 averages on its
entries). A method reads its group (:class:`~sparcml.torch.runtime.Group`: the
config, the communicator, its operators and its own runtime state) and returns
what it did; it never writes into the group's counters. A registration
carries:

* ``kind``: the method's key (``"dense"``, ``"sparse"``, ...);
* ``config``: its typed config, a frozen dataclass (:class:`MethodConfig`) whose
  fields are the method's own hyperparameters, validated at construction
  (``TopK(density=0.01, selector="trimmed_topk")``, ``OkTopk(tau=64)``);
* ``names``: the method names that select it; ``None`` for the compressor-based
  kinds, which match :mod:`sparcml.compress` names instead (``"sparse"``: a
  selector or ``selector+quantizer``; ``"quantized"``: a quantizer alone);
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
* ``reference``: it is the dense allreduce the pipeline's warm-up steps run
  (``dense``): the pipeline runs it as step 1 and nothing else;
* ``sparse_gradients``: it takes a parameter's sparse (COO) gradient
  (``nn.Embedding(sparse=True)``);
* ``scatter``: its reduce-scatter for FSDP2 (:mod:`sparcml.torch.fsdp`), or None;
* ``runtime``: builds the method's own state for one group (e.g. the aggregator
  session of ``natural_ina``), or None;
* ``description``: one line for ``sparcml methods``.

Adding a method: one module in this package with its config, its run function and
``register_method(...)``; the package imports every module in it (no list to edit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ...compress.base import available, split_composition
from ...stream import SparseStream
from ..rules import Density, check_density, describe_schedule

if TYPE_CHECKING:
    from ...comm import Communicator
    from ..bucket import Bucket
    from ..settings import PipelineSettings

__all__ = [
    "GroupView",
    "MethodConfig",
    "MethodResult",
    "MethodSpec",
    "config_of",
    "method_kind",
    "method_spec",
    "methods",
    "register_method",
    "registered",
]


@dataclasses.dataclass
class MethodResult:
    """What a method did with one bucket: this rank's sent part (dense, a stream
    over the bucket, or None when nothing is fed back), the sum over ranks (flat, or
    a stream over the bucket, which the pipeline averages on its entries before
    densifying; this rank's dense chunk for a reduce-scatter), the seconds its
    selection took (statistics: compress vs communicate) and whether ``sent`` holds
    every non-zero of what the method was given, exactly (the residual is then zero:
    :meth:`~sparcml.compress.base.Selector.select_covering`)."""

    sent: torch.Tensor | SparseStream | None
    total: torch.Tensor | SparseStream
    select_s: float = 0.0
    covering: bool = False


class GroupView(Protocol):
    """What a method reads from its parameter group (:class:`~sparcml.torch.runtime.Group`):
    its config, the pipeline settings, the communicator, the density of the step,
    its operators, its own runtime state and the parameter names."""

    config: MethodConfig
    settings: PipelineSettings
    comm: Communicator
    method_state: Any
    param_names: dict[int, str]

    @property
    def density(self) -> float | None: ...

    def operator(self, key: tuple[str, ...]) -> Any: ...

    def cached_operator(self, key: tuple[str, ...], build: Callable[[], Any]) -> Any: ...


#: step 5 of the pipeline: ``run(group, bucket, acc)``. ``acc`` is read-only: it may
#: be the group's momentum buffer itself (momentum correction without error
#: feedback), which the pipeline keeps after the call
RunFn = Callable[[GroupView, "Bucket", torch.Tensor], MethodResult]
ScatterFn = Callable[[GroupView, "Bucket", torch.Tensor, list[int]], MethodResult]


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Base of the methods' typed configs (frozen dataclasses, validated at construction).

    Subclasses declare the method's own hyperparameters as fields. Fields named in
    ``NAME_FIELDS`` are read from the method name (``selector``/``quantizer`` of
    ``"topk+natural"``) and make it up again (:attr:`name`).
    """

    kind: ClassVar[str] = ""
    NAME_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        density = getattr(self, "density", None)
        if density is not None:
            if callable(density):
                check_density(density(0), "density schedule at step 0")
            else:
                object.__setattr__(self, "density", check_density(density))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming a bad value (called once, at construction)."""

    @property
    def name(self) -> str:
        """The method name (``"topk+natural"``, ``"oktopk"``, ...)."""
        return self.kind

    @classmethod
    def from_name(cls, name: str, options: Mapping[str, Any]) -> MethodConfig:
        """The config of method ``name`` with ``options`` (its own field names)."""
        return cls(**options)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields a user sets by keyword (the name's own fields excluded)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.NAME_FIELDS)

    def options(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a layer rule inherits)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in self.NAME_FIELDS or f.name == "density":
                continue
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            if getattr(self, f.name) != default:
                out[f.name] = getattr(self, f.name)
        return out

    def settings(self) -> dict[str, Any]:
        """The values every rank must share (compared at registration; secrets excluded)."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in self.NAME_FIELDS and f.name != "density"
        }


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: repr(x) for k, x in sorted(v.items())}
    if isinstance(v, (bytes, bytearray)):
        return None  # secrets never travel
    if callable(v):
        return describe_schedule(v)
    return v


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Every fact about one training method (see the module docstring)."""

    kind: str
    description: str
    run: RunFn
    config: type[MethodConfig]
    names: tuple[str, ...] | None = None
    unbiased: bool = False
    operator: bool = False
    checks_nonfinite: bool = False
    carries_nonfinite: bool = False
    averages: bool = False
    lossless: bool = False
    reference: bool = False
    sparse_gradients: bool = False
    scatter: ScatterFn | None = None
    runtime: Callable[[], Any] | None = None

    @property
    def needs_momentum_correction(self) -> bool:
        """It keeps a residual: the optimizer's momentum must move to the state."""
        return not self.unbiased


_METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry (by its ``kind``); its config learns its kind."""
    if spec.kind in _METHODS and _METHODS[spec.kind] is not spec:
        raise ValueError(f"a training method of kind {spec.kind!r} is already registered")
    owner = vars(spec.config).get("kind")  # (set on this class itself, not inherited)
    if owner and owner != spec.kind:
        raise ValueError(
            f"{spec.config.__name__} is already the config of method {owner!r}; "
            f"give {spec.kind!r} a config class of its own"
        )
    spec.config.kind = spec.kind
    _METHODS[spec.kind] = spec
    return spec


def registered() -> list[MethodSpec]:
    """Every registered method, in registration order."""
    return list(_METHODS.values())


def method_spec(method: str | MethodConfig) -> MethodSpec:
    """The registration of a method kind, a method name or a config.

    Raises:
        ValueError: an unknown name, or a config class no method registered.
    """
    if isinstance(method, MethodConfig):
        spec = _METHODS.get(method.kind)
        if spec is None or spec.config is not type(method):
            raise ValueError(
                f"{type(method).__name__} is not the config of a registered method "
                "(register_method(MethodSpec(..., config=...)) registers one)"
            )
        return spec
    spec = _METHODS.get(method)
    return spec if spec is not None else _METHODS[method_kind(method)]


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
    try:
        first, second = split_composition(method)
    except ValueError:
        first, second = method, "?"
    if second is None and kinds.get(first) == "selector":
        return "sparse"
    if second is None and kinds.get(first) == "quantizer":
        return "quantized"
    if kinds.get(first) == "selector" and second is not None and kinds.get(second) == "quantizer":
        return "sparse"
    raise ValueError(
        f"unknown method {method!r}; use one of {', '.join(sorted(methods()))} "
        "or a 'selector+quantizer' composition such as 'topk+natural'"
    )


def config_of(
    method: str | MethodConfig,
    density: Density | None = None,
    options: Mapping[str, Any] = {},
    others: Sequence[str] = (),
) -> MethodConfig:
    """The typed config of a method given by name and keyword options, resolved once.

    ``density`` goes to the methods that select (those with a ``density`` field);
    the others send every entry and take none (it is ignored, so that one density
    can serve a model's layer rules). Any other option must be a field of the
    method's config; ``others`` names what else the caller takes (for the error).

    Raises:
        ValueError: an unknown method, an option the method does not take (naming
            its real fields), or a bad value.
    """
    if isinstance(method, MethodConfig):
        if options:
            fields = ", ".join(type(method).field_names()) or "none"
            raise ValueError(
                f"unknown option(s) {', '.join(sorted(options))} next to the config "
                f"{type(method).__name__}: its own options go in the config ({fields})"
                + (f"; the pipeline's settings: {', '.join(others)}" if others else "")
            )
        if density is not None and "density" in _field_set(type(method)):
            return dataclasses.replace(method, density=density)  # type: ignore[type-var]
        return method
    if not isinstance(method, str):
        raise TypeError(
            f"method must be a name or a method config (sparcml.torch.TopK(...), ...), "
            f"got {type(method).__name__}"
        )
    spec = _METHODS[method_kind(method)]
    cls = spec.config
    takes = cls.field_names()
    if "algorithm" in options and "algorithm" not in takes:
        if options["algorithm"] != "auto":
            raise ValueError(
                f"algorithm={options['algorithm']!r} does not apply to method {method!r}: "
                "only selector methods ('topk', 'topk+natural', ...) and 'nonzeros' run a "
                "sparse allreduce algorithm; leave algorithm='auto'"
            )
        options = {k: v for k, v in options.items() if k != "algorithm"}
    options = dict(options)
    if "density" in options:  # (a layer rule's options may carry it)
        density = options.pop("density")
    unknown = sorted(k for k in options if k not in takes)
    if unknown:
        mine = ", ".join(k for k in takes) or "none"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for method {method!r}; its options: "
            f"{mine} (config class sparcml.torch.methods.{cls.__name__})"
            + (f"; the pipeline's settings: {', '.join(others)}" if others else "")
        )
    fields = dict(options)
    if density is not None and "density" in takes:
        fields["density"] = density
    return cls.from_name(method, fields)


def _field_set(cls: type[MethodConfig]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


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
