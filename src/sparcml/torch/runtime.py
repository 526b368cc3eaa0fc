"""Runtime of one parameter group: what the pipeline keeps across steps.

A :class:`~sparcml.torch.SparcmlState` reduces its parameters in groups: the
default group (the state's method) and one per layer rule. Each group holds its
method's typed config and the pipeline settings (both frozen), and the state that
changes from step to step: error-feedback residuals and DGC momenta per parameter
name (:mod:`sparcml.sgd.feedback`), the operators per bucket (selectors that
reuse a threshold keep it), the method's own runtime state (made by its
registration's ``runtime``: Ok-Topk's thresholds per bucket, the aggregator
session), and the group's statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..comm import Communicator
from ..compress import get
from ..compress.base import accepted_params
from ..sgd.feedback import ErrorFeedback, MomentumCorrection
from .methods import MethodConfig, method_spec
from .rules import check_density
from .settings import PipelineSettings
from .stats import GroupStats

__all__ = ["Group", "ParamNames"]


class ParamNames(dict[int, str]):
    """Parameter names by ``id``, shared by a state's groups. ``in_bucket_order``:
    the DDP hook named them as buckets first brought them (``param0``, ... in
    reverse registration order: the hook never sees the model), so the names say
    nothing of which layer is the model's last (RedSync's ``output_layer="auto"``)."""

    in_bucket_order = False


class Group:
    """One parameter group: a method's config, the pipeline settings and the runtime.

    Args:
        config: the method's typed config.
        settings: the pipeline settings.
        comm: the communicator the group's collectives run on.
        label: the statistics' label (``"default"`` or the layer rule's).
        param_names: parameter names by ``id`` (shared with the state: RedSync's
            output layer is the last registered one).
        error_feedback: None: the method's default (on for biased methods).
        operators: operators already built, by bucket key (the one-tensor steps
            hand theirs over).
    """

    def __init__(
        self,
        config: MethodConfig,
        settings: PipelineSettings,
        comm: Communicator,
        label: str = "default",
        param_names: dict[int, str] | None = None,
        error_feedback: bool | None = None,
        operators: dict[tuple[str, ...], Any] | None = None,
    ) -> None:
        self.config = config
        self.spec = method_spec(config)
        self.settings = settings
        self.comm = comm
        unbiased = self.spec.unbiased
        if error_feedback and unbiased:
            raise ValueError(
                f"error feedback applies to sparse methods; {config.name!r} sends every "
                "entry (unbiased quantizers need none)"
            )
        self.error_feedback = (not unbiased) if error_feedback is None else bool(error_feedback)
        self.feedback = ErrorFeedback()
        self.momentum_correction = MomentumCorrection(settings.momentum, settings.momentum_masking)
        self.operators: dict[tuple[str, ...], Any] = dict(operators or {})
        self.method_state: Any = self.spec.runtime() if self.spec.runtime else None
        self.stats = GroupStats(label, config.name)
        self.param_names: dict[int, str] = {} if param_names is None else param_names
        self.schedule_step = 0
        if self.spec.operator and not self.operators:  # bad parameters fail here, not later
            self.make_operator()

    @property
    def method(self) -> str:
        """The method's name (``"topk+natural"``, ...)."""
        return self.config.name

    @property
    def density(self) -> float | None:
        """The density of the step being reduced (a schedule's value at it); None for
        methods that send every entry."""
        d = getattr(self.config, "density", None)
        if callable(d):
            return check_density(d(self.schedule_step), f"density at step {self.schedule_step}")
        return d

    def make_operator(self) -> Any:
        """A fresh selector / ``selector+quantizer`` / quantizer for this method."""
        params = dict(getattr(self.config, "compressor_params", {}))
        accepted = accepted_params(self.config.name)
        if self.density is not None and "k" not in params and "density" in accepted:
            params.setdefault("density", self.density)
        if "seed" in accepted:
            params.setdefault("seed", self.settings.seed)
        return get(self.config.name, **params)

    def operator(self, key: tuple[str, ...]) -> Any:
        """The operator of one bucket (kept: selectors that reuse thresholds across
        calls keep them per bucket), rebuilt when the density changed."""
        return self.cached_operator(key, self.make_operator)

    def cached_operator(self, key: tuple[str, ...], build: Callable[[], Any]) -> Any:
        """The operator kept under ``key``, rebuilt when the density changed since it
        was built (a threshold reused from another density would be wrong)."""
        d = self.density
        op = self.operators.get(key)
        if op is None or getattr(op, "sparcml_density", d) != d:
            op = build()
            if op is not None:
                op.sparcml_density = d
            self.operators[key] = op
        return op

    def reset(self) -> None:
        """Forget residuals, momenta, operators and the method's runtime state."""
        self.feedback.reset()
        self.momentum_correction.reset()
        self.operators.clear()
        self.method_state = self.spec.runtime() if self.spec.runtime else None
