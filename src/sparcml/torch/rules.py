"""Per-layer rules and schedules: which method and density each parameter gets, per step.

Users of DGC, PowerSGD, Horovod and CGX expect three controls that the papers
use but do not name as an API (this module is beyond the five reference papers):

* **Per-layer rules** (:class:`LayerRule`): parameters matched by name pattern
  and/or size are synchronised by a method of their own. RedSync's small-layer
  rule (paper 002 sec. 3.2: layers under 128 KB are sent uncompressed), CGX's
  ``layer_min_size`` and PowerSGD's ``min_compression_rate`` are instances:
  ``SparcmlState("topk+natural", layers=[("*.bias", "dense")], dense_below=1024)``.
  The first matching rule wins; parameters no rule matches use the state's own
  method. A rule may hold only on some steps (``when=lambda step: ...``): a
  per-step method schedule.
* **Density schedules**: ``density`` may be a callable ``step -> density``;
  :class:`DensityWarmup` is DGC's warm-up (Lin et al., ICLR 2018, sec. 3.3:
  the density falls exponentially over the first epochs, 25% -> 6.25% ->
  1.5625% -> 0.39% -> 0.1%).
* Changing ``state.density`` between steps takes effect at the next step.

A rule's parameters keep their own residuals and operators (a child
:class:`~sparcml.torch.SparcmlState` per rule, on the same communicator); the
statistics are kept per group (``state.group_stats()``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "DensityWarmup",
    "LayerRule",
    "StepRange",
    "check_density",
    "describe_schedule",
    "rules_from",
]

Density = float | Callable[[int], float]


def check_density(value: float, what: str = "density") -> float:
    """``value`` as a float in (0, 1]; ``ValueError`` naming ``what`` otherwise (a
    bool too: ``True`` is no density, though ``float(True)`` is 1)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number in (0, 1], got {value!r}")
    try:
        d = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {value!r}") from None
    if not 0.0 < d <= 1.0 or math.isnan(d):
        raise ValueError(f"{what} must be in (0, 1], got {value!r}")
    return d


def describe_schedule(density: Density | None) -> Any:
    """What every rank must agree on about a density (compared at registration):
    the number, or the schedule's ``repr`` (dataclasses such as
    :class:`DensityWarmup` print their parameters; a function its qualified name);
    None for none."""
    if density is None:
        return None
    if callable(density):
        if dataclasses.is_dataclass(density):
            return repr(density)
        return f"schedule:{getattr(density, '__qualname__', type(density).__qualname__)}"
    return float(density)


@dataclasses.dataclass(frozen=True)
class StepRange:
    """A rule's ``when`` that holds on steps ``start <= step < stop`` (``stop`` None:
    every step from ``start`` on): the data form of a method schedule, as config files
    write it (``steps: {from: 0, until: 500}``, :mod:`sparcml.torch.config`).

    Example:
        >>> [StepRange(2, 4)(s) for s in range(5)]
        [False, False, True, True, False]
    """

    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.stop is not None and self.stop < self.start):
            raise ValueError(
                f"a step range needs 0 <= from <= until, got {self.start}, {self.stop}"
            )

    def __call__(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)


@dataclasses.dataclass(frozen=True)
class DensityWarmup:
    """DGC's density warm-up: ``start * (end / start) ** (epoch / epochs)`` during the
    first ``epochs`` epochs, ``end`` afterwards. DGC sec. 3.3 lists sparsity 75%,
    93.75%, 98.4375%, 99.6% for the first four epochs, then 99.9%; this geometric
    form gives densities 25%, 6.29%, 1.58%, 0.40%, then 0.1%.

    Args:
        steps_per_epoch: optimizer steps per epoch (``len(loader)``).
        epochs: warm-up epochs (DGC: 4).
        start: density of the first epoch (DGC: 0.25).
        end: final density (DGC: 0.001).

    Example:
        >>> w = DensityWarmup(steps_per_epoch=100, epochs=4, start=0.25, end=0.001)
        >>> [round(w(s), 6) for s in (0, 99, 100, 200, 300, 400, 10**6)]
        [0.25, 0.25, 0.062872, 0.015811, 0.003976, 0.001, 0.001]
    """

    steps_per_epoch: int
    epochs: int = 4
    start: float = 0.25
    end: float = 0.001

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {self.steps_per_epoch}")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        check_density(self.start, "DensityWarmup start")
        check_density(self.end, "DensityWarmup end")

    def __call__(self, step: int) -> float:
        epoch = step // self.steps_per_epoch
        if epoch >= self.epochs:
            return self.end
        return self.start * (self.end / self.start) ** (epoch / self.epochs)


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """Route matching parameters to a method of their own.

    Args:
        method: the method for these parameters (``"dense"``, ``"nonzeros"``,
            ``"topk"``, ``"topk+natural"``, ... see :func:`sparcml.torch.methods`).
        pattern: a shell-style pattern on the parameter name (``"*.bias"``,
            ``"embed.*"``, ``"*norm*"``), also tried on ``"." + name`` so that
            ``"*.bias"`` matches a top-level module's ``"bias"``; None matches
            every name.
        min_numel / max_numel: only parameters with at least / at most this many
            entries (CGX's ``layer_min_size`` is ``max_numel=min_size - 1`` with
            ``method="dense"``).
        density: the density of these parameters (a number or a schedule); None:
            the state's.
        when: ``step -> bool``; the rule holds only on the steps where it returns
            True (a method schedule); None: every step.
        options: the method's own options (``{"algorithm": "ssar_split_allgather"}``,
            ``{"index_coding": "delta"}``, ...).
        label: the group's name in statistics (default: ``"pattern -> method"``).
    """

    method: str
    pattern: str | None = None
    min_numel: int | None = None
    max_numel: int | None = None
    density: Density | None = None
    when: Callable[[int], bool] | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise TypeError(f"LayerRule method must be a method name, got {self.method!r}")
        for what in ("min_numel", "max_numel"):
            v = getattr(self, what)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"LayerRule {what} must be a non-negative integer, got {v!r}")
        if self.density is not None and not callable(self.density):
            check_density(self.density, f"LayerRule({self.method!r}) density")

    def matches(self, name: str, numel: int, step: int) -> bool:
        """Whether this rule routes parameter ``name`` (``numel`` entries) at ``step``."""
        if self.pattern is not None and not (
            fnmatch.fnmatchcase(name, self.pattern) or fnmatch.fnmatchcase("." + name, self.pattern)
        ):
            return False
        if self.min_numel is not None and numel < self.min_numel:
            return False
        if self.max_numel is not None and numel > self.max_numel:
            return False
        return self.when is None or bool(self.when(step))

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        parts = [self.pattern or "*"]
        if self.min_numel is not None:
            parts.append(f">= {self.min_numel}")
        if self.max_numel is not None:
            parts.append(f"<= {self.max_numel}")
        if self.when is not None:
            parts.append("when ...")
        return f"{' '.join(parts)} -> {self.method}"

    def describe(self) -> dict[str, Any]:
        """The rule as plain data (compared across ranks at registration)."""
        return {
            "method": self.method,
            "pattern": self.pattern,
            "min_numel": self.min_numel,
            "max_numel": self.max_numel,
            "density": None if self.density is None else describe_schedule(self.density),
            "when": None if self.when is None else describe_schedule(self.when),
            "options": {k: repr(v) for k, v in sorted(self.options.items())},
        }


def rules_from(
    layers: Sequence[LayerRule | tuple[str, str]] | None, dense_below: int
) -> tuple[LayerRule, ...]:
    """The state's rules: ``layers`` in order (``(pattern, method)`` pairs allowed),
    then ``dense_below`` as a last rule (parameters with fewer entries go dense)."""
    out: list[LayerRule] = []
    for i, rule in enumerate(layers or ()):
        if isinstance(rule, LayerRule):
            out.append(rule)
        elif isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(x, str) for x in rule):
            out.append(LayerRule(rule[1], pattern=rule[0]))
        else:
            raise TypeError(
                f"layers[{i}] must be a LayerRule or a (pattern, method) pair, got {rule!r}"
            )
    if not isinstance(dense_below, int) or dense_below < 0:
        raise ValueError(f"dense_below must be a non-negative integer, got {dense_below!r}")
    if dense_below:
        out.append(LayerRule("dense", max_numel=dense_below - 1, label=f"< {dense_below} -> dense"))
    return tuple(out)
