"""The state object of sparcml's gradient synchronisation (DDP hook and explicit sync).

Modelled on PyTorch's ``PowerSGDState``: hyperparameters are constructor
arguments, checked at once; internal fields (residuals, momenta, per-tensor
selector and Ok-Topk states, the step counter, traffic counters) live on the
object and persist across steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import OkTopkState
from ..comm import Communicator, SelfCommunicator, TorchDistCommunicator
from ..comm import refuse_silent_world_of_one as _refuse_silent_world_of_one
from ..compress import get
from ..compress.base import operator_class
from ..merge import warm_kernels
from ..sgd.feedback import ErrorFeedback, MomentumCorrection
from .config import resolve_method
from .methods import MethodConfig, method_kind, method_spec, methods, valid_algorithms
from .rules import Density, LayerRule, check_density, describe_schedule, rules_from
from .stats import GroupStats

__all__ = [
    "SparcmlState",
    "method_kind",
    "methods",
    "needs_momentum_correction",
    "valid_algorithms",
]

log = logging.getLogger("sparcml")

PIPELINE = (
    "error_feedback",
    "warmup_steps",
    "momentum",
    "momentum_masking",
    "clip_norm",
    "clip_scope",
    "nan_policy",
    "bucket_bytes",
    "seed",
    "layers",
    "dense_below",
    "residual_precision",
    "stats_every",
    "stats_ranks",
)

RESIDUAL_PRECISIONS = ("float32", "gradient")


def needs_momentum_correction(method: str) -> bool:
    """True for methods that keep a residual (error feedback): selectors, ``oktopk``,
    ``redsync``. Their residual and an optimizer's momentum amplify each other and
    training diverges; give the momentum to the state (``momentum=0.9``, DGC momentum
    correction) and use the optimizer without momentum."""
    return not method_spec(method_kind(method)).unbiased


def _route(method: str, config: type[MethodConfig], options: dict[str, Any]) -> MethodConfig:
    """The method's config from the keyword arguments that name its fields.

    Options of *other* methods are ignored (one set of hyperparameters may serve a
    sweep over methods), logged at debug level; a name no method takes raises.
    """
    from .methods.base import all_options

    fields = {f.name for f in dataclasses.fields(config)}
    if "algorithm" in options and "algorithm" not in fields and options["algorithm"] != "auto":
        raise ValueError(
            f"algorithm={options['algorithm']!r} does not apply to method {method!r}: only "
            "selector methods ('topk', 'topk+natural', ...) and 'nonzeros' run a sparse "
            "allreduce algorithm; leave algorithm='auto'"
        )
    owners = all_options()
    unknown = sorted(o for o in options if o not in fields and o not in owners)
    if unknown:
        takes = ", ".join(sorted(fields)) or "none"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for method {method!r}; its own options: "
            f"{takes}; other methods': {', '.join(sorted(set(owners) - fields))}; the "
            f"pipeline's: density, {', '.join(PIPELINE)}, comm, timeout"
        )
    ignored = sorted(set(options) - fields)
    if ignored:
        log.debug("method %r ignores %s (options of other methods)", method, ", ".join(ignored))
    return config(**{k: v for k, v in options.items() if k in fields})


class SparcmlState:
    """Hyperparameters and internal state of sparcml's gradient synchronisation.

    Args:
        method: what to run per bucket (see :func:`methods`): ``"dense"``, ``"topk"``
            (any selector; SparCML's TopK SGD, Alg. 1), ``"topk+natural"`` (any
            selector+quantizer: quantized TopK SGD), ``"oktopk"``, ``"redsync"``,
            ``"qsgd"``, ``"natural"``, ``"natural_dithering"``, ``"dithering"``, and
            ``"nonzeros"`` (lossless: the gradient's own non-zeros, no selection).
        density: fraction of each bucket's (or layer's, for ``redsync``) entries a
            rank selects (sparse methods). Default 0.01. A callable ``step ->
            density`` is a schedule (:class:`~sparcml.torch.rules.DensityWarmup` is
            DGC's warm-up); assigning ``state.density`` between steps takes effect
            at the next step.

    The method's own options (``algorithm``, ``compressor_params``, ``quantize``,
    ``index_coding``, ``oktopk_*``, ``redsync_*``, ``ina_*``) are keyword arguments
    routed by name to the method's config dataclass (:mod:`sparcml.torch.methods`;
    ``state.config``, also readable as ``state.<option>``); options of other methods
    are ignored, unknown names refused. They are:

        algorithm: sparse allreduce algorithm of the selector methods and ``nonzeros``
            (:func:`sparcml.algorithms`, default ``"auto"``).
        compressor_params: extra hyperparameters of the selector/quantizer
            (``{"bits": 4, "bucket": 512}`` for QSGD, ``{"levels": 8}`` ...).
        error_feedback: keep what was not sent and add it to the next gradient.
            Default: on for sparse methods (they are biased), off for unbiased
            quantizers (``qsgd``, ``natural``, dithering).
        warmup_steps: the first steps synchronise densely (RedSync sec. 3.5; DGC).
        momentum: DGC momentum correction (paper 002 sec. 3.5): accumulate
            ``u = m u + g; v = v + u`` locally and send from ``v``. Use a plain SGD
            optimizer (no momentum) with it. 0 disables it.
        momentum_masking: DGC momentum factor masking: zero ``u`` where ``v`` was sent.
        clip_norm: DGC/RedSync local gradient clipping: each rank clips its bucket's
            gradient to ``clip_norm / sqrt(P)`` before accumulating it (the hook sees
            one bucket at a time, so the norm is the bucket's; ``sync_gradients``
            with one bucket clips the whole model).
        clip_scope: ``"bucket"`` (default; per bucket, a deviation from RedSync where
            a model has several buckets) or ``"model"``: RedSync's sec. 3.5 local
            clipping of the whole local gradient, for :func:`sync_gradients` and
            ``DistributedOptimizer`` (the DDP hook refuses it: it never sees the
            whole gradient).
        nan_policy: ``"propagate"`` (NaN/Inf travel like in dense allreduce) or
            ``"raise"``: every rank checks its gradient and all ranks raise the same
            :class:`FloatingPointError` naming the ranks and parameters (costs one
            tiny allreduce per bucket).
        oktopk_tau / oktopk_tau_prime: Ok-Topk's re-estimation periods (paper 001).
        redsync_asq: RedSync's alternating-sign quantization on top of the selection.
        redsync_asq_feedback: what an ASQ-sent entry leaves in the residual:
            ``"paper"`` (default; RedSync Alg. 1: the entries outside the
            communication set become the new residual, the sent ones restart at
            zero) or ``"quantization_error"`` (``x - mean``: the quantization error
            is fed back too; beyond the paper).
        redsync_output_layer: the layer RedSync leaves unquantized under ASQ ("we
            also do not quantify the output layer"): ``"auto"`` (the module of the
            last registered parameter), a parameter-name prefix, or None (quantize
            every compressed layer). It is still sparsified.
        quantize: for ``selector+quantizer`` methods, which messages are quantized:
            ``"contributions"`` (default, SparCML's Alg. 1: each rank's selection
            quantized once, partial sums exact, the same error whatever algorithm
            ``auto`` picks), ``"all"`` (partial sums re-quantized at every stage:
            fewer bytes, 1.4-3.3x the squared error) or ``"dense"``.
        index_coding: ``"delta"``: indices of quantized sparse messages (``topk+natural``
            and other ``selector+quantizer`` methods) as varints of their gaps.
        redsync_min_bytes: layers smaller than this are not compressed (sent dense),
            RedSync's 128 KB (sec. 3.2's hybrid strategy).
        redsync_bsearch_numel: layers with at least this many entries use threshold
            binary search (sampled, unless ASQ), smaller ones trimmed top-k.
        bucket_bytes: bucket size of :func:`~sparcml.torch.sync_gradients`.
        layers: per-layer rules (:class:`~sparcml.torch.rules.LayerRule`, or
            ``(pattern, method)`` pairs), first match wins: e.g.
            ``[("*.bias", "dense"), ("embed.*", "nonzeros")]``. Each rule's
            parameters are reduced by its method, with residuals, operators and
            statistics of their own (:meth:`group_stats`).
        dense_below: parameters with fewer entries are sent dense (CGX's
            ``layer_min_size``; a last rule after ``layers``). Default 0: none.
        residual_precision: ``"float32"`` (default): with float16/bfloat16
            gradients the error-feedback residuals and DGC momenta are kept in
            float32 (4 bytes per compressed parameter instead of 2; what is sent
            is still 16-bit, so ``sent + residual == accumulated`` holds exactly
            in float32); ``"gradient"``: in the gradient's dtype (half the memory,
            small residual entries are lost to rounding).
        stats_every: log :meth:`group_stats` through ``logging`` (logger
            ``sparcml.stats``, INFO) every this many steps, under every entry point
            (the DDP hook, ``sync_gradients``, ``DistributedOptimizer``); 0: never.
        stats_ranks: which ranks log them: ``"first"`` (rank 0, the default) or
            ``"all"`` (every rank its own line).
        ina_server / ina_job / ina_mode: ``natural_ina``'s aggregator (``"host:port"``),
            a label mixed into the rounding seed (jobs on one aggregator are told
            apart by a random session the ranks agree on at the first step, not by
            this number), ``"natural"`` (8-bit codes) or ``"fixed"`` (int32 fixed point).
        ina_secret: the aggregator's secret (``sparcml ina-server --secret-file``),
            the same on every rank: every packet is then tagged with a per-session
            key each rank derives from it (docs/ina.md's threat model); ranks with
            different secrets all fail at the first step.
        seed: seed of random selectors/quantizers (ranks agree where they must).
        comm: the communicator. Default: a dedicated process group of its own when
            torch.distributed is initialised (a collective call: create states in
            the same order on every rank), otherwise a world of one.
        timeout: seconds to wait for a peer in the dedicated group.

    Attributes:
        step: completed synchronisation steps.
        bytes_sent: bytes this rank sent for gradients so far; ``step_bytes`` per step.
    """

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
    ) -> SparcmlState:
        """A state from a config: a mapping, or a JSON/YAML file's path, holding the
        method and this class's keyword arguments by name (layer rules, schedules
        and method options included; :mod:`sparcml.torch.config`); ``overrides``
        replace its entries (``comm=`` goes here). Checked as the keywords are.

        Example:
            >>> SparcmlState.from_config({"method": "topk", "density": 0.05}).density
            0.05
        """
        method, options = resolve_method(config, overrides)
        return cls(method, **options)

    def __init__(
        self,
        method: str = "topk",
        density: float = 0.01,
        *,
        error_feedback: bool | None = None,
        warmup_steps: int = 0,
        momentum: float = 0.0,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        clip_scope: str = "bucket",
        nan_policy: str = "propagate",
        bucket_bytes: int = 25 * 1024 * 1024,
        seed: int = 0,
        layers: Sequence[LayerRule | tuple[str, str]] | None = None,
        dense_below: int = 0,
        residual_precision: str = "float32",
        stats_every: int = 0,
        stats_ranks: str = "first",
        comm: Communicator | None = None,
        timeout: float = 300.0,
        _parent: SparcmlState | None = None,
        **method_options: Any,
    ) -> None:
        self.kind = method_kind(method)
        self.method = method
        spec = method_spec(self.kind)
        # the method's own hyperparameters, by name (before anything communicates)
        self.config = _route(method, spec.config, method_options)
        self.config.validate(method)
        self._schedule_step = 0
        self.density = density  # type: ignore[assignment]  # (a number or a schedule)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        if clip_scope not in ("bucket", "model"):
            raise ValueError(f"clip_scope must be 'bucket' or 'model', got {clip_scope!r}")
        if nan_policy not in ("propagate", "raise"):
            raise ValueError(f"nan_policy must be 'propagate' or 'raise', got {nan_policy!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if residual_precision not in RESIDUAL_PRECISIONS:
            raise ValueError(
                f"residual_precision must be one of {RESIDUAL_PRECISIONS}, "
                f"got {residual_precision!r}"
            )
        if not isinstance(stats_every, int) or stats_every < 0:
            raise ValueError(f"stats_every must be a non-negative integer, got {stats_every!r}")
        self.residual_precision = residual_precision
        if stats_ranks not in ("first", "all"):
            raise ValueError(f"stats_ranks must be 'first' or 'all', got {stats_ranks!r}")
        self.stats_every = stats_every
        self.stats_ranks = stats_ranks
        unbiased = spec.unbiased
        if error_feedback and unbiased:
            raise ValueError(
                f"error feedback applies to sparse methods; {method!r} sends every entry "
                "(unbiased quantizers need none)"
            )
        self.error_feedback = (not unbiased) if error_feedback is None else bool(error_feedback)
        if momentum and unbiased and _parent is None:
            # (a rule's unbiased method under a momentum-corrected state runs dense
            # momentum SGD: u = m u + g, sent whole, as warm-up steps do)
            raise ValueError(
                "momentum correction applies to sparse methods; use the optimizer's momentum"
            )
        self.warmup_steps = warmup_steps
        # residuals and DGC momenta per parameter name (sparcml.sgd.feedback)
        self.feedback = ErrorFeedback()
        self.momentum_correction = MomentumCorrection(momentum, momentum_masking)
        self.clip_norm = clip_norm
        self.clip_scope = clip_scope
        self.nan_policy = nan_policy
        self.bucket_bytes = bucket_bytes
        self.seed = seed
        self.ina_calls = 0
        self.select_s = 0.0  # the selector's time in the bucket being reduced (statistics)
        self.ina_session: Any = None  # an InaSession, agreed at the first call
        # Build one operator now so that bad parameters fail here, not mid-training.
        if spec.operator:
            self._make_operator()
        if comm is None and _parent is not None:
            comm = _parent.comm
        if comm is None:
            if dist.is_available() and dist.is_initialized():
                comm = TorchDistCommunicator.dedicated(timeout=timeout)
            else:
                _refuse_silent_world_of_one()
                comm = SelfCommunicator()
        self.comm = comm
        if comm.world_size > 1 and _parent is None:
            # the compiled kernels' first load, here rather than inside a step's
            # collective, where it would stall every rank at an unknown step
            warm_kernels()
        # ------------------------------------------------------------- internal fields
        self.step = 0
        self.bytes_sent = 0
        self.step_bytes: list[int] = []
        self.operators: dict[tuple[str, ...], Any] = {}
        self.oktopk_states: dict[tuple[str, ...], OkTopkState] = {}
        self.param_names: dict[int, str] = {}
        self.param_shapes: dict[str, tuple[int, ...]] = {}  # by name, once registered
        self._checkpoint_parameters: dict[str, tuple[int, ...]] | None = None
        self.registered: str | None = None
        self.hook_error: BaseException | None = None  # raised at the end of backward
        self.hook_armed = False
        self.hook_works: list[Any] = []
        # the DDP bucket keys of the last step, and after a resume the checkpoint's
        # (sparcml.torch.layout)
        self.layout: list[tuple[str, ...]] = []
        self.replay_layout: list[tuple[str, ...]] | None = None
        # per-layer rules: a child state per rule, on the same communicator
        self.parent = _parent
        if _parent is not None and (layers or dense_below):
            raise ValueError("a layer rule's method cannot have layer rules of its own")
        self.rules = rules_from(layers, dense_below)
        self.children = [self._child(r, method_options) for r in self.rules]
        self.stats = GroupStats("default" if _parent is None else "", method)
        for rule, child in zip(self.rules, self.children, strict=True):
            child.stats = GroupStats(rule.name, rule.method)
        self._routes: dict[tuple[str, ...], list[tuple[SparcmlState, list[int]]]] = {}

    def __getattr__(self, name: str) -> Any:
        """The chosen method's hyperparameters read as attributes (``state.algorithm``,
        ``state.redsync_asq``, ...): they live in ``state.config``."""
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(
            f"{type(self).__name__} of method {self.__dict__.get('method')!r} has no attribute "
            f"{name!r}"
        )

    # ------------------------------------------------------------------ density
    @property
    def density(self) -> float:
        """The density of the step being reduced (the schedule's value, if one is set)."""
        d = self._density
        if callable(d):
            return check_density(d(self._schedule_step), f"density at step {self._schedule_step}")
        return d

    @density.setter
    def density(self, value: Density) -> None:
        """A number in (0, 1] or a schedule ``step -> density``; takes effect at the next
        step (operators built for another density are rebuilt)."""
        if callable(value):
            check_density(value(self._schedule_step), "density schedule at step 0")
            self._density: Density = value
        else:
            self._density = check_density(value)

    @property
    def density_schedule(self) -> Density:
        """The density as given: a number or a schedule."""
        return self._density

    def at_step(self, step: int) -> None:
        """Evaluate schedules at ``step`` (the pipeline calls it before each bucket)."""
        self._schedule_step = step

    # ------------------------------------------------------------------ layer rules
    def _child(self, rule: LayerRule, options: dict[str, Any]) -> SparcmlState:
        """The state that reduces a rule's parameters: the parent's pipeline settings,
        the rule's method, density and options (the parent's method options that the
        rule's method takes are inherited)."""
        try:
            config = method_spec(method_kind(rule.method)).config
            fields = {f.name for f in dataclasses.fields(config)}
            inherited = {k: v for k, v in options.items() if k in fields}
            return SparcmlState(
                rule.method,
                self._density if rule.density is None else rule.density,
                warmup_steps=self.warmup_steps,
                momentum=self.momentum,
                momentum_masking=self.momentum_masking,
                clip_norm=self.clip_norm,
                clip_scope=self.clip_scope,
                nan_policy=self.nan_policy,
                bucket_bytes=self.bucket_bytes,
                seed=self.seed,
                residual_precision=self.residual_precision,
                _parent=self,
                **{**inherited, **dict(rule.options)},
            )
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer rule {rule.name!r}: {e}") from None

    def group_of(self, name: str, numel: int, step: int) -> SparcmlState:
        """The state (this one or a rule's) that reduces parameter ``name`` at ``step``."""
        for rule, child in zip(self.rules, self.children, strict=True):
            if rule.matches(name, numel, step):
                return child
        return self

    def routes(
        self, names: tuple[str, ...], sizes: tuple[int, ...], step: int
    ) -> list[tuple[SparcmlState, list[int]]]:
        """A bucket's parameters grouped by the state that reduces them, groups in
        order of their first parameter (the same on every rank); cached per bucket
        unless a rule depends on the step."""
        timed = any(r.when is not None for r in self.rules)
        got = None if timed else self._routes.get(names)
        if got is None:
            groups: dict[int, tuple[SparcmlState, list[int]]] = {}
            for i, (name, n) in enumerate(zip(names, sizes, strict=True)):
                st = self.group_of(name, n, step)
                groups.setdefault(id(st), (st, []))[1].append(i)
            got = list(groups.values())
            if not timed:
                self._routes[names] = got
        return got

    def group_stats(self) -> dict[str, GroupStats]:
        """Statistics per parameter group (the state's own method: ``"default"``; one
        per layer rule): bytes, compression ratio, selected count vs k, time split."""
        from .stats import residual_norm

        out = {}
        for st in (self, *self.children):
            st.stats.residual_norm = residual_norm(st)
            out[st.stats.label] = st.stats
        return out

    # ------------------------------------------------------------------ feedback
    @property
    def momentum(self) -> float:
        """DGC momentum correction's ``m`` (0: off)."""
        return self.momentum_correction.momentum

    @property
    def momentum_masking(self) -> bool:
        return self.momentum_correction.masking

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals by parameter name (``self.feedback``'s)."""
        return self.feedback.buffers

    @residuals.setter
    def residuals(self, value: dict[str, torch.Tensor]) -> None:
        self.feedback.buffers = value

    @property
    def momenta(self) -> dict[str, torch.Tensor]:
        """DGC's momenta ``u`` by parameter name (``self.momentum_correction``'s)."""
        return self.momentum_correction.buffers

    @momenta.setter
    def momenta(self, value: dict[str, torch.Tensor]) -> None:
        self.momentum_correction.buffers = value

    @property
    def ina_address(self) -> tuple[str, int] | None:
        return self.config.address if self.kind == "natural_ina" else None

    # ------------------------------------------------------------------ operators
    def _make_operator(self) -> Any:
        """A fresh selector / ``selector+quantizer`` / quantizer for this method."""
        params = dict(getattr(self.config, "compressor_params", {}))
        accepted = _init_params(self.method)
        if self.kind == "sparse" and "k" not in params and "density" in accepted:
            params.setdefault("density", self.density)
        if "seed" in accepted:
            params.setdefault("seed", self.seed)
        return get(self.method, **params)

    def operator(self, key: tuple[str, ...]) -> Any:
        """The selector (or composition / quantizer) of one bucket; selectors that
        reuse thresholds across calls keep their state per bucket."""
        if self.kind == "sparse":
            return self.cached_operator(key, self._make_operator)
        op = self.operators.get(key)
        if op is None:
            op = self._make_operator()
            self.operators[key] = op
        return op

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

    def oktopk_state(self, key: tuple[str, ...]) -> OkTopkState:
        st = self.oktopk_states.get(key)
        if st is None:
            st = OkTopkState(tau=self.oktopk_tau, tau_prime=self.oktopk_tau_prime)
            self.oktopk_states[key] = st
        return st

    def name_of(self, param: torch.Tensor, position: int, bucket: int) -> str:
        """The name a parameter's residual is kept under (stable across bucket rebuilds)."""
        name = self.param_names.get(id(param))
        return name if name is not None else f"bucket{bucket}.param{position}"

    def set_parameters(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The parameters this state reduces (registration: the DDP hook,
        ``sync_gradients``' first call). A checkpoint loaded before (strictly) must
        have been made with the same names and shapes.

        Raises:
            ValueError: a loaded checkpoint's parameters differ, naming the first.
        """
        self.param_names = {id(p): n for n, p in named}
        self.param_shapes = {n: tuple(p.shape) for n, p in named}
        expected, self._checkpoint_parameters = self._checkpoint_parameters, None
        if expected is not None:
            _check_parameters(expected, self.param_shapes)

    def _checkpoint_settings(self) -> dict[str, Any]:
        """What a checkpoint must be resumed with: every setting that changes what is
        computed (the aggregator's address and the statistics cadence do not)."""
        out = self.settings()
        out.pop("ina_server", None)
        return out

    def settings(self) -> dict[str, Any]:
        """The hyperparameters every rank must share (compared at registration):
        the pipeline's and the method's own (secrets excluded)."""
        return {
            "method": self.method,
            "density": describe_schedule(self._density),
            "error_feedback": self.error_feedback,
            "warmup_steps": self.warmup_steps,
            "momentum": self.momentum,
            "momentum_masking": self.momentum_masking,
            "clip_norm": self.clip_norm,
            "clip_scope": self.clip_scope,
            "nan_policy": self.nan_policy,
            "bucket_bytes": self.bucket_bytes,
            "seed": self.seed,
            "residual_precision": self.residual_precision,
            "layers": [
                {**r.describe(), "settings": c.settings()}
                for r, c in zip(self.rules, self.children, strict=True)
            ],
            **self.config.settings(),
        }

    def check(self) -> None:
        """Raise (once) the error a DDP hook call stored, if backward has not raised it.

        The hook re-raises its errors at the end of ``loss.backward()``; call this
        after a backward run outside autograd's engine, or to be sure.
        """
        err, self.hook_error = self.hook_error, None
        if err is not None:
            raise err

    def reset(self) -> None:
        """Forget residuals, momenta and reused thresholds (e.g. after loading a checkpoint)."""
        self.feedback.reset()
        self.momentum_correction.reset()
        self.operators.clear()
        self.oktopk_states.clear()
        for child in self.children:
            child.reset()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state as tensors and plain data (per-rank: save
        one per rank; see :mod:`sparcml.torch.checkpoint`). Call it between steps."""
        from . import checkpoint as ck

        return {
            "version": 2,
            # every setting that changes what is computed, and the parameters:
            # load_state_dict refuses another configuration (strict=True)
            "settings": self._checkpoint_settings(),
            "parameters": {n: list(s) for n, s in self.param_shapes.items()},
            "method": self.method,
            "density": describe_schedule(self._density),
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "step_bytes": list(self.step_bytes),
            "ina_calls": self.ina_calls,
            # the collective call number: quantizers' rounding seeds derive from it
            "comm_sequence": self.comm.sequence,
            "residuals": ck.tensors(self.residuals),
            "momenta": ck.tensors(self.momenta),
            "operators": ck.keyed(self.operators),
            "oktopk_states": ck.keyed(self.oktopk_states),
            "layout": [list(k) for k in self.layout],
            "groups": [c.state_dict() for c in self.children],
        }

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore what :meth:`state_dict` saved; the run then continues bitwise as
        the uninterrupted one would (with the same model, optimizer and data).

        Args:
            state_dict: what :meth:`state_dict` returned (on this rank).
            strict: refuse a checkpoint made with other settings (method options,
                density, momentum and masking, error feedback, algorithm, clipping,
                seed, layer rules, ...) or other parameters (names, shapes), naming
                what differs. ``False`` loads it anyway (logged as a warning): for a
                deliberate change of settings between runs. A checkpoint of another
                world size or rank is refused either way. Checkpoints of version 1
                (before settings were saved) load with a warning that nothing could
                be checked.

        Raises:
            ValueError: a setting, the parameters, the world size or the rank differ.
        """
        from . import checkpoint as ck

        sd = state_dict
        mine = (self.comm.world_size, self.comm.rank)
        theirs = (sd["world_size"], sd["rank"])
        if mine != theirs:
            raise ValueError(
                f"sparcml checkpoint of (world size, rank) = {theirs}, this state is {mine}"
            )
        saved = sd.get("settings")
        if saved is None:
            old = {"method": sd["method"], "density": sd["density"]}
            now = {"method": self.method, "density": describe_schedule(self._density)}
            _check_settings(old, now, strict)
            log.warning("sparcml checkpoint of version %s carries no settings: only its "
                        "method and density could be checked", sd.get("version"))  # fmt: skip
        else:
            _check_settings(saved, self._checkpoint_settings(), strict)
        params = {n: tuple(v) for n, v in sd.get("parameters", {}).items()}
        if params and strict:
            if self.param_shapes:
                _check_parameters(params, self.param_shapes)
            else:  # checked when the model is registered (set_parameters)
                self._checkpoint_parameters = params
        self.step = int(sd["step"])
        self.bytes_sent = int(sd["bytes_sent"])
        self.step_bytes = [int(b) for b in sd["step_bytes"]]
        self.ina_calls = int(sd["ina_calls"])
        # the aggregator binds results to (session, call): a rewound call counter in
        # the same session would reuse call numbers, so the next call agrees a new one
        self.ina_session = None
        self.comm.sequence = int(sd["comm_sequence"])
        self.residuals = ck.tensors(sd["residuals"])
        self.momenta = ck.tensors(sd["momenta"])
        self.operators = ck.unkeyed(sd["operators"])
        self.oktopk_states = ck.unkeyed(sd["oktopk_states"])
        self.layout = [tuple(k) for k in sd["layout"]]
        self.replay_layout = list(self.layout) or None
        groups = sd.get("groups", [])
        if len(groups) != len(self.children):
            raise ValueError(
                f"sparcml checkpoint with {len(groups)} layer rule groups, this state has "
                f"{len(self.children)}"
            )
        for child, child_sd in zip(self.children, groups, strict=True):
            child.load_state_dict(child_sd, strict)

    def __repr__(self) -> str:
        return (
            f"SparcmlState(method={self.method!r}, density={describe_schedule(self._density)}, "
            f"config={self.config!r}, error_feedback={self.error_feedback}, "
            f"warmup_steps={self.warmup_steps}, momentum={self.momentum}, step={self.step}, "
            f"world_size={self.comm.world_size})"
        )


def _check_settings(saved: dict[str, Any], now: dict[str, Any], strict: bool) -> None:
    """Refuse (``strict``) or log a checkpoint made with other settings."""
    diffs = [
        f"{k} (checkpoint: {saved.get(k)!r}, this state: {now.get(k)!r})"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if not diffs:
        return
    text = "sparcml checkpoint made with other settings: " + "; ".join(diffs)
    if strict:
        raise ValueError(
            text + ". Build the state with the checkpoint's settings, or pass "
            "load_state_dict(..., strict=False) to load it anyway"
        )
    log.warning("%s (loaded anyway: strict=False)", text)


def _check_parameters(saved: dict[str, tuple[int, ...]], now: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint of other parameters, naming the first difference."""
    if saved == now:
        return
    missing = [n for n in saved if n not in now]
    extra = [n for n in now if n not in saved]
    shaped = [f"{n} {tuple(saved[n])} -> {tuple(now[n])}" for n in saved
              if n in now and tuple(saved[n]) != tuple(now[n])]  # fmt: skip
    parts = []
    if shaped:
        parts.append(f"shapes differ: {', '.join(shaped[:3])}")
    if missing:
        parts.append(f"not in this model: {', '.join(missing[:3])}")
    if extra:
        parts.append(f"not in the checkpoint: {', '.join(extra[:3])}")
    if not parts:
        parts.append("the parameters come in another order")
    raise ValueError(
        "sparcml checkpoint of other parameters ("
        + "; ".join(parts)
        + "): it belongs to another model. load_state_dict(..., strict=False) skips this check"
    )


def _init_params(method: str) -> set[str]:
    import inspect

    names: set[str] = set()
    for part in method.split("+"):
        cls = operator_class(part)
        if cls is not None:
            names |= set(inspect.signature(cls.__init__).parameters)
    return names
