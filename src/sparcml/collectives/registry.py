"""The algorithm registry: the one place that knows an allreduce algorithm.

An algorithm is ``fn(stream, comm, codec, **options) -> SparseStream`` written SPMD
style against the :class:`~sparcml.comm.Communicator` interface, in a file of its
own, registered there with every fact the rest of the library needs::

    def cost(model, p, n, ks, isize):          # the docstring's alpha-beta-gamma bound
        return ...

    @register("my_allreduce", cost=cost, auto=True)
    def my_allreduce(stream, comm=None, codec=EXACT): ...

``sparse_allreduce(algorithm=...)``, ``algorithm="auto"`` (the candidates and
their cost formulas), the simulator (what to run, what to check, which
algorithms do ``P^2`` local work), ``sparcml bench`` / ``bench-topk`` (which
algorithms to time, what input they take, how to check them) and the tests
parameterised over algorithms all read this registry. Adding a collective is one
new file: ``collectives/__init__.py`` imports every module of the package. The
registry holds facts; what ``auto`` makes of them (the plan) is :mod:`.autotune`'s.

Facts (:class:`AlgorithmInfo`):

* ``exact``: the result is the sum of the ranks' inputs (False for the top-k
  family: ``gtopk``, ``gaussiank``, ``oktopk``, whose result is by design not);
* ``input``: what a rank passes: ``"stream"`` (any sparse stream),
  ``"selection"`` (its local top-k: TopkA, TopkDSA, gTopk) or ``"accumulator"``
  (its dense accumulator; the algorithm selects itself: Gaussiank, Ok-Topk);
* ``auto``: ``algorithm="auto"`` may pick it; ``auto_priority`` orders the
  candidates for ties (lower first: at ``P = 1`` every prediction is 0);
* ``cost``: ``cost(model, P, N, ks, isize) -> seconds`` under a
  :class:`~sparcml.costmodel.CostModel` (None: no formula);
* ``quadratic``: every rank does ``O(P)`` work per call (splits into ``P``
  pieces or decodes ``P`` messages), so the simulator caps ``P`` for it;
* ``family``: ``"sparcml"`` (SparCML's sparse allreduce) and/or ``"topk"``
  (Ok-Topk's comparison: dense, TopkA, TopkDSA, gTopk, Gaussiank, Ok-Topk);
* ``header_in_first_round``: its first round (at ``P > 1``) is
  :func:`~sparcml.collectives._common.split_and_reduce`, a message to every peer,
  which then carries the call's consistency header; an explicit
  ``algorithm=`` call skips the header's own exchange (``log2 P`` rounds), and
  so does ``auto`` once every call it made on the communicator settled on this
  algorithm (its choice otherwise needs every rank's nnz first);
* ``header_in_rounds``: its rounds are the header exchange's own messages
  (recursive doubling with Appendix A's fold), each carrying the headers its
  sender holds (:class:`~sparcml.collectives.codec.CarriedHeaders`): an explicit
  call skips the exchange, and so does ``auto`` when the previous call of the
  same size, value size and codec settled on it (a rank that exchanges first
  instead sends the same messages, so a mix is refused on every rank, not hung);
* ``dense_result``: its result is always dense (``N`` values whatever the
  nnz), or, for a two-level algorithm, its inner algorithm's between nodes:
  ``sparse_allreduce`` refuses a size whose dense result cannot fit in the
  device's memory before any message, naming ``N`` and the bytes (a two-level
  algorithm also with ``inner=`` naming such an algorithm, and on one node as
  well: the topology is not known before the first message);
* ``two_level``: it reduces inside each node first and between nodes after
  (:mod:`sparcml.comm.topology`); its cost formula reads the model's
  ``ranks_per_node`` and both cost pairs, and ``auto`` considers it only when
  the ranks span several nodes with several ranks each;
* ``node_aware``: a flat algorithm that, on ranks spanning several nodes of
  several ranks, arranges its exchange by the nodes itself (TopkA and Gaussiank:
  the allgather of
  :func:`~sparcml.collectives.sparse_allgather.allgather_buffers_on_nodes`, across
  nodes lane by lane, then inside the node; gTopk: its tree over the ranks in node
  order); its cost formula reads the model's ``ranks_per_node`` and both cost
  pairs, as a ``two_level`` one's does, but it runs on one node too (beyond paper
  001);
* ``shares_nic``: on a topology with several ranks per node, the node's ranks
  send through one NIC at once, so :func:`predict` costs a flat algorithm's
  messages at ``1/ranks_per_node`` of the bandwidth (False for the dense ring,
  whose only messages between nodes are one per node and direction);
* ``variant_of``: it is another registered algorithm with one option fixed (a
  two-level algorithm with another flat algorithm between nodes:
  ``twolevel_shard+dsar_split_allgather`` is ``twolevel_shard(inner=
  "dsar_split_allgather")``), registered by :func:`register_variant` (the base's
  facts, its own function and cost, and ``dense_result`` where the fixed option
  makes the result dense) so that ``auto`` can choose it; the benchmark
  and simulator defaults and the parameterised tests leave variants out
  (``algorithms(variants=False)``; ``algorithms()`` includes them, as every name a
  call may pass), and ``auto`` measures only the variant of each algorithm its
  model ranks best;
* ``options``: the keyword options it takes (``k``, ``state``), from its signature.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ..costmodel import CostModel
    from ..stream import SparseStream

__all__ = [
    "Algorithm",
    "AlgorithmInfo",
    "CostFn",
    "algorithm_info",
    "algorithms",
    "check_options",
    "get_algorithm",
    "predict",
    "register",
    "register_variant",
]

Algorithm = Callable[..., "SparseStream"]
CostFn = Callable[["CostModel", int, int, Sequence[int], int], float]
F = TypeVar("F", bound=Callable[..., "SparseStream"])

INPUTS = ("stream", "selection", "accumulator")
FAMILIES = ("sparcml", "topk")


@dataclasses.dataclass(frozen=True)
class AlgorithmInfo:
    """Every fact about one registered algorithm (see the module docstring)."""

    name: str
    fn: Algorithm
    exact: bool = True
    input: str = "stream"
    auto: bool = False
    cost: CostFn | None = None
    quadratic: bool = False
    family: frozenset[str] = frozenset({"sparcml"})
    alias_of: str | None = None
    auto_priority: int = 0
    header_in_first_round: bool = False
    header_in_rounds: bool = False
    dense_result: bool = False
    two_level: bool = False
    shares_nic: bool = True
    node_aware: bool = False
    variant_of: str | None = None

    @property
    def base(self) -> str:
        """The algorithm this one is a variant of, or its own name."""
        return self.variant_of or self.name

    @property
    def options(self) -> tuple[str, ...]:
        """Keyword options beyond ``(stream, comm, codec)``, e.g. ``("k", "state")``."""
        return options_of(self.fn)

    @property
    def required_options(self) -> tuple[str, ...]:
        """The options a call must pass (no default: ``k``, ``state``); an algorithm
        without any can reduce any stream as it is (the training hooks' choice)."""
        return required_options_of(self.fn)

    @property
    def summary(self) -> str:
        """The first line of the algorithm's docstring."""
        return (inspect.getdoc(self.fn) or self.name).splitlines()[0]


_REGISTRY: dict[str, AlgorithmInfo] = {}


def register(
    name: str,
    *,
    exact: bool = True,
    input: str = "stream",
    auto: bool = False,
    cost: CostFn | None = None,
    quadratic: bool = False,
    family: Sequence[str] = ("sparcml",),
    auto_priority: int = 0,
    header_in_first_round: bool = False,
    header_in_rounds: bool = False,
    dense_result: bool = False,
    two_level: bool = False,
    shares_nic: bool = True,
    node_aware: bool = False,
) -> Callable[[F], F]:
    """Decorator adding an allreduce algorithm to the registry under ``name``.

    Args:
        name: the ``algorithm=`` name.
        exact, input, auto, cost, quadratic, family, auto_priority,
            header_in_first_round, header_in_rounds, dense_result, two_level,
            shares_nic, node_aware: the facts of
            :class:`AlgorithmInfo` (module docstring).

    Raises:
        ValueError: the name is taken by another function, or a fact is invalid.
    """
    if input not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {input!r}")
    unknown = sorted(set(family) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown algorithm family {unknown}; known: {', '.join(FAMILIES)}")
    if header_in_first_round and header_in_rounds:
        raise ValueError(f"{name}: the header rides in the first round or in every round")
    if auto and (not exact or cost is None or input != "stream"):
        raise ValueError(f"{name}: 'auto' candidates must be exact, take a stream, have a cost")

    def deco(fn: F) -> F:
        old = _REGISTRY.get(name)
        if old is not None and old.fn is not fn:
            raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
        alias = next((i.name for i in _REGISTRY.values() if i.fn is fn and i.name != name), None)
        _REGISTRY[name] = AlgorithmInfo(
            name, fn, exact, input, auto, cost, quadratic, frozenset(family), alias,
            auto_priority, header_in_first_round, header_in_rounds, dense_result,
            two_level, shares_nic, node_aware,
        )  # fmt: skip
        return fn

    return deco


def register_variant(
    base: str, name: str, fn: Algorithm, cost: CostFn, *, dense_result: bool | None = None
) -> None:
    """Register ``name`` as a variant of ``base`` (fact ``variant_of``): ``fn`` is
    ``base``'s function with an option fixed, ``cost`` its cost formula,
    ``dense_result`` the fact when the option changes it; every other fact is
    ``base``'s.

    Raises:
        ValueError: ``base`` is unknown, or ``name`` is taken by another function.
    """
    info = algorithm_info(base)
    old = _REGISTRY.get(name)
    if old is not None and old.fn is not fn:
        raise ValueError(f"an allreduce algorithm named {name!r} is already registered")
    dense = info.dense_result if dense_result is None else dense_result
    _REGISTRY[name] = dataclasses.replace(
        info, name=name, fn=fn, cost=cost, alias_of=None, variant_of=base, dense_result=dense
    )


def algorithm_info(name: str) -> AlgorithmInfo:
    """The facts of the algorithm registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown allreduce algorithm {name!r}; known: auto, {known}") from None


def get_algorithm(name: str) -> Algorithm:
    """The function registered as ``name`` (raises ``ValueError`` if unknown)."""
    return algorithm_info(name).fn


@functools.cache
def options_of(fn: Algorithm) -> tuple[str, ...]:
    """The keyword options ``fn`` takes (its signature is read once, not per call)."""
    params = inspect.signature(fn).parameters
    return tuple(p for p in params if p not in ("stream", "comm", "codec"))


@functools.cache
def required_options_of(fn: Algorithm) -> tuple[str, ...]:
    """The keyword options of ``fn`` without a default."""
    params = inspect.signature(fn).parameters
    return tuple(p for p in options_of(fn) if params[p].default is inspect.Parameter.empty)


def check_options(fn: Algorithm, name: str, options: dict[str, object]) -> None:
    """Raise a clear error for options the algorithm does not take."""
    if not options:
        return
    takes = options_of(fn)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        hint = f"it takes {', '.join(takes)}" if takes else "it takes no options"
        raise ValueError(f"algorithm {name!r} has no option(s) {', '.join(unknown)}; {hint}")


def algorithms(
    exact: bool | None = None,
    *,
    auto: bool | None = None,
    family: str | None = None,
    aliases: bool = True,
    variants: bool = True,
) -> list[str]:
    """Names of the registered algorithms, sorted, filtered by their facts.

    Args:
        exact: True for those whose result is the sum of the inputs, False for the
            top-k family, None for all.
        auto: True for ``auto``'s candidates.
        family: ``"sparcml"`` or ``"topk"``.
        aliases: include names registered for a function already registered
            under another name (``topkdsa`` is ``ssar_split_allgather``).
        variants: include an algorithm's variants with an option fixed
            (``twolevel_shard+dsar_split_allgather``).
    """
    return sorted(
        i.name
        for i in _REGISTRY.values()
        if (exact is None or i.exact == exact)
        and (auto is None or i.auto == auto)
        and (family is None or family in i.family)
        and (aliases or i.alias_of is None)
        and (variants or i.variant_of is None)
    )


def predict(
    model: CostModel, name: str, world_size: int, size: int, ks: Sequence[int], isize: int
) -> float:
    """Predicted seconds of ``name`` for ``P`` ranks holding ``ks[i]`` pairs of ``N``.

    On a model for several ranks per node (:meth:`~sparcml.costmodel.CostModel.for_topology`)
    a flat algorithm that ``shares_nic`` is costed with the NIC's bandwidth shared
    by the node's ranks (a ``two_level`` or ``node_aware`` one costs the two levels
    itself) (:meth:`~sparcml.costmodel.CostModel.sharing_nic`), a
    conservative bound: its messages inside a node are costed as if they crossed it.

    Raises:
        ValueError: unknown algorithm, or one without a cost formula.
    """
    info = algorithm_info(name)
    if info.cost is None:
        raise ValueError(f"algorithm {name!r} has no cost formula")
    if world_size == 1:
        return 0.0
    if model.ranks_per_node > 1 and not (info.two_level or info.node_aware):
        rpn = model.ranks_per_node
        model = model.sharing_nic(rpn) if info.shares_nic else model.for_topology(1)
    return info.cost(model, world_size, size, ks, isize)


def describe() -> list[dict[str, Any]]:
    """One row of facts per algorithm (for ``sparcml algorithms`` and the docs)."""
    return [
        {
            "name": i.name,
            "exact": i.exact,
            "input": i.input,
            "auto": i.auto,
            "cost": i.cost is not None,
            "options": ",".join(i.options),
            "family": ",".join(sorted(i.family)),
            "two_level": i.two_level,
            "alias_of": i.alias_of,
            "variant_of": i.variant_of,
            "summary": i.summary,
        }
        for i in sorted(_REGISTRY.values(), key=lambda i: i.name)
    ]
