"""The state of sparcml's gradient synchronisation (DDP hook, explicit sync, FSDP2).

Modelled on PyTorch's ``PowerSGDState``, with its arguments in three groups:

* the **method's config**, typed and passed whole (``TopK(density=0.01)``,
  ``OkTopk(tau=64)``; :mod:`sparcml.torch.methods`), or a method name with its
  options as keywords (``SparcmlState("topk", density=0.01)``), resolved once, at
  construction, into the typed config;
* the **pipeline settings** (:class:`~sparcml.torch.settings.PipelineSettings`:
  warm-up, clipping, NaN policy, momentum correction, residual precision,
  statistics), frozen;
* the **runtime**: one :class:`~sparcml.torch.runtime.Group` per parameter group
  (the state's method, and one per layer rule) with its residuals, momenta,
  operators and statistics, and the state's counters (step, bytes), kept across
  steps and saved by :meth:`SparcmlState.state_dict`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm import Communicator, SelfCommunicator
from ..comm import refuse_silent_world_of_one as _refuse_silent_world_of_one
from ..compress.warmup import warm_kernels
from ..sgd.feedback import ErrorFeedback, MomentumCorrection
from .config import resolved_or_noted
from .construction import checked_in_group, noting_refusal
from .methods import MethodConfig, config_of, method_spec, methods
from .rules import Density, LayerRule, describe_schedule, rules_from
from .runtime import Group, ParamNames
from .settings import PipelineSettings
from .stats import GroupStats, residual_norm

__all__ = ["SparcmlState", "methods", "needs_momentum_correction"]

log = logging.getLogger("sparcml")

#: checkpoint format; version 2 named the method options with a prefix
CHECKPOINT_VERSION = 3
_V2_NAMES = {
    "oktopk_tau": "tau",
    "oktopk_tau_prime": "tau_prime",
    "redsync_asq": "asq",
    "redsync_asq_feedback": "asq_feedback",
    "redsync_output_layer": "output_layer",
    "redsync_min_bytes": "min_bytes",
    "redsync_bsearch_numel": "bsearch_numel",
    "ina_server": "server",
    "ina_job": "job",
    "ina_mode": "mode",
    "ina_secret": "secret",
}


def needs_momentum_correction(method: str | MethodConfig) -> bool:
    """True for methods that keep a residual (error feedback): selectors, ``oktopk``,
    ``redsync``. Their residual and an optimizer's momentum amplify each other and
    training diverges; give the momentum to the state (``momentum=0.9``, DGC momentum
    correction) and use the optimizer without momentum."""
    return method_spec(method).needs_momentum_correction


class SparcmlState:
    """Method config, pipeline settings and runtime of sparcml's gradient synchronisation.

    Args:
        method: a method config (``sparcml.torch.TopK(density=0.01)``, ``OkTopk``,
            ``RedSync``, ``Quantized``, ``Nonzeros``, ``NaturalIna``, ``Dense``,
            ``Fp16``, ``Bf16``), or a method name (:func:`methods`): ``"dense"``,
            ``"topk"`` (any selector; SparCML's TopK SGD, Alg. 1), ``"topk+natural"``
            (any selector+quantizer), ``"oktopk"``, ``"redsync"``, ``"qsgd"``,
            ``"natural"``, ``"natural_dithering"``, ``"dithering"``, ``"nonzeros"``,
            ``"fp16"``, ``"bf16"``, ``"natural_ina"``; its options are then keyword
            arguments by the config's field names (``tau=``, ``algorithm=``, ...).
        density: fraction of each bucket's (or layer's, for ``redsync``) entries a
            rank selects, for the methods that select; default 0.01. A callable
            ``step -> density`` is a schedule (:class:`~sparcml.torch.rules.DensityWarmup`
            is DGC's warm-up); assigning ``state.density`` between steps takes effect
            at the next step (a method that sends every entry has none: assigning
            raises ``ValueError``; given here, it is ignored and layer rules inherit it;
            rules' groups keep the density they were built with).
        settings: the pipeline settings, whole; or give them as keywords
            (``warmup_steps=``, ``momentum=``, ``clip_norm=``, ... see
            :class:`~sparcml.torch.settings.PipelineSettings`).
        layers: per-layer rules (:class:`~sparcml.torch.rules.LayerRule`, or
            ``(pattern, method)`` pairs), first match wins: e.g.
            ``[("*.bias", "dense"), ("embed.*", "nonzeros")]``. Each rule's
            parameters are reduced by its method, with residuals, operators and
            statistics of their own (:meth:`group_stats`).
        dense_below: parameters with fewer entries are sent dense (CGX's
            ``layer_min_size``; a last rule after ``layers``). Default 0: none.
        comm: the communicator. Default: a dedicated process group of its own when
            torch.distributed is initialised (a collective call: create states in
            the same order on every rank), otherwise a world of one.
        timeout: seconds to wait for a peer in the dedicated group.
        **options: the pipeline settings and the method's options by name.

    Raises:
        ValueError: an unknown method, an option neither the pipeline nor the method
            takes (naming the method's real options), or a bad value.

    Attributes:
        config: the method's typed config; ``settings``: the pipeline settings.
        step: completed synchronisation steps.
        bytes_sent: bytes this rank sent for gradients so far; ``step_bytes`` per step.
        groups: the parameter groups' runtime (the state's method first, then one
            per layer rule).
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
        method, options = resolved_or_noted(config, overrides)
        return cls(method, **options)

    def __init__(
        self,
        method: str | MethodConfig = "topk",
        density: Density | None = None,
        *,
        settings: PipelineSettings | None = None,
        layers: Sequence[LayerRule | tuple[str, str]] | None = None,
        dense_below: int = 0,
        comm: Communicator | None = None,
        timeout: float = 300.0,
        **options: Any,
    ) -> None:
        joins = comm is None and dist.is_available() and dist.is_initialized()
        # (the others wait for this rank's verdict: sparcml.torch.construction)
        with noting_refusal(joins):
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
            if not 0 < timeout < math.inf:
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
            settings, rules, configs = _validated(
                method, density, settings, layers, dense_below, options
            )
            if joins:  # what the groups refuse (their operators' parameters), before it
                _groups(configs, settings, rules, SelfCommunicator(), {})
        self.settings = settings
        if comm is None:
            if joins:
                comm = checked_in_group(timeout)
            else:
                _refuse_silent_world_of_one()
                comm = SelfCommunicator()
        self.comm = comm
        if comm.world_size > 1:
            # the compiled kernels' first load, here rather than inside a step's
            # collective, where it would stall every rank at an unknown step
            warm_kernels()
        self.rules = rules
        #: parameter names by id (registration), shared by every group
        self.param_names = ParamNames()
        self.groups = _groups(configs, settings, rules, comm, self.param_names)
        # ------------------------------------------------------------- counters
        self.step = 0
        self.bytes_sent = 0
        self.step_bytes: list[int] = []
        self.param_shapes: dict[str, tuple[int, ...]] = {}  # by name, once registered
        self.checkpoint_parameters: dict[str, tuple[int, ...]] | None = None
        # ------------------------------------------------------------- registration
        self.registered: str | None = None
        self.sync_ids: list[int] | None = None  # sync_gradients' parameters
        self.sparse_ids: set[int] = set()  # parameters with sparse gradients
        self.hook_error: BaseException | None = None  # raised at the end of backward
        self.hook_error_step = -1  # the step of the backward that stored it
        self.hook_armed = False
        self.hook_works: list[Any] = []
        # the DDP bucket keys of the last step (and of the step being reduced), and
        # after a resume the checkpoint's (sparcml.torch.layout)
        self.layout: list[tuple[str, ...]] = []
        self.layout_now: list[tuple[str, ...]] = []
        self.replay_layout: list[tuple[str, ...]] | None = None
        self._routes: dict[tuple[str, ...], list[tuple[Group, list[int]]]] = {}

    # ------------------------------------------------------------------ the method
    @property
    def config(self) -> MethodConfig:
        """The method's typed config (the default group's)."""
        return self.groups[0].config

    @property
    def method(self) -> str:
        """The method's name (``"topk+natural"``, ...)."""
        return self.config.name

    @property
    def kind(self) -> str:
        """The method's registered kind (``"sparse"``, ``"oktopk"``, ...)."""
        return self.groups[0].spec.kind

    @property
    def error_feedback(self) -> bool:
        return self.groups[0].error_feedback

    @property
    def density(self) -> float | None:
        """The density of the step being reduced (the schedule's value, if one is set);
        None for a method that sends every entry."""
        return self.groups[0].density

    @density.setter
    def density(self, value: Density) -> None:
        """A number in (0, 1] or a schedule ``step -> density``; takes effect at the next
        step (operators built for another density are rebuilt)."""
        group = self.groups[0]
        if getattr(group.config, "density", None) is None:
            raise ValueError(f"method {self.method!r} selects nothing: it has no density")
        group.config = dataclasses.replace(group.config, density=value)  # type: ignore[type-var]

    @property
    def children(self) -> list[Group]:
        """The layer rules' groups (in the order of the rules)."""
        return self.groups[1:]

    @property
    def stats(self) -> GroupStats:
        return self.groups[0].stats

    @property
    def feedback(self) -> ErrorFeedback:
        return self.groups[0].feedback

    @property
    def momentum_correction(self) -> MomentumCorrection:
        return self.groups[0].momentum_correction

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """The default group's error-feedback residuals by parameter name."""
        return self.groups[0].feedback.buffers

    @property
    def momenta(self) -> dict[str, torch.Tensor]:
        """The default group's DGC momenta ``u`` by parameter name."""
        return self.groups[0].momentum_correction.buffers

    def at_step(self, step: int) -> None:
        """Evaluate density schedules at ``step`` (the pipeline calls it per bucket)."""
        for group in self.groups:
            group.schedule_step = step

    # ------------------------------------------------------------------ layer rules
    def group_of(self, name: str, numel: int, step: int) -> Group:
        """The group (the state's method, or a rule's) that reduces parameter ``name``."""
        for rule, group in zip(self.rules, self.groups[1:], strict=True):
            if rule.matches(name, numel, step):
                return group
        return self.groups[0]

    def routes(
        self, names: tuple[str, ...], sizes: tuple[int, ...], step: int
    ) -> list[tuple[Group, list[int]]]:
        """A bucket's parameters grouped by the group that reduces them, groups in
        order of their first parameter (the same on every rank); cached per bucket
        unless a rule depends on the step."""
        timed = any(r.when is not None for r in self.rules)
        got = None if timed else self._routes.get(names)
        if got is None:
            groups: dict[int, tuple[Group, list[int]]] = {}
            for i, (name, n) in enumerate(zip(names, sizes, strict=True)):
                g = self.group_of(name, n, step)
                groups.setdefault(id(g), (g, []))[1].append(i)
            got = list(groups.values())
            if not timed:
                self._routes[names] = got
        return got

    def group_stats(self) -> dict[str, GroupStats]:
        """Statistics per parameter group (the state's own method: ``"default"``; one
        per layer rule): bytes, compression ratio, selected count vs k, time split."""
        out = {}
        for group in self.groups:
            group.stats.residual_norm = residual_norm(group.feedback.buffers)
            out[group.stats.label] = group.stats
        return out

    # ------------------------------------------------------------------ registration
    def name_of(self, param: torch.Tensor, position: int, bucket: int) -> str:
        """The name a parameter's residual is kept under (stable across bucket rebuilds).

        A parameter the state was not told of (``sparcml_hook`` registered by hand,
        without :func:`~sparcml.torch.register`) is named ``param0``, ``param1``, ...
        when a bucket first brings it, the same on every rank, as PyTorch's ``(state,
        hook)`` pair does: a name by bucket position would hand its residual to
        another parameter once DDP rebuilds its buckets after the first step.
        """
        name = self.param_names.get(id(param))
        if name is None:
            i = len(self.param_names)
            while f"param{i}" in self.param_shapes:  # (names given before may have gaps)
                i += 1
            name = self.param_names[id(param)] = f"param{i}"
            self.param_shapes[name] = tuple(param.shape)
            self.param_names.in_bucket_order = True
        return name

    def set_parameters(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The parameters this state reduces (registration: the DDP hook,
        ``sync_gradients``' first call). A checkpoint loaded before (strictly) must
        have been made with the same names and shapes.

        Raises:
            ValueError: a loaded checkpoint's parameters differ, naming the first.
        """
        self.param_names.clear()
        self.param_names.update({id(p): n for n, p in named})
        self.param_names.in_bucket_order = False
        self.param_shapes = {n: tuple(p.shape) for n, p in named}
        self.check_checkpoint_parameters()

    def check_checkpoint_parameters(self) -> None:
        """Compare the parameters of a checkpoint loaded (strictly) before this state
        knew its own with :attr:`param_shapes` now, once: at registration, or, for
        PyTorch's ``(state, hook)`` pair, whose hook meets the parameters one bucket
        at a time, after the first step's last bucket.

        Raises:
            ValueError: the checkpoint's parameters differ, naming the first.
        """
        expected, self.checkpoint_parameters = self.checkpoint_parameters, None
        if expected is not None:
            _check_parameters(expected, self.param_shapes)

    def settings_dict(self) -> dict[str, Any]:
        """The hyperparameters every rank must share (compared at registration):
        the pipeline's, the method's own and the layer rules' (secrets excluded)."""
        return {
            **_group_settings(self.groups[0], self.settings),
            "layers": [
                {**r.describe(), "settings": {**_group_settings(g, self.settings), "layers": []}}
                for r, g in zip(self.rules, self.groups[1:], strict=True)
            ],
        }

    def _checkpoint_settings(self) -> dict[str, Any]:
        """What a checkpoint must be resumed with: every setting that changes what is
        computed (the aggregator's address and the statistics cadence do not)."""
        out = self.settings_dict()
        out.pop("server", None)
        return out

    def check(self) -> None:
        """Raise (once) the error a DDP hook call stored, if backward has not raised it.

        The hook re-raises its errors at the end of ``loss.backward()``; call this
        after a backward run outside autograd's engine, or to be sure.
        """
        err, self.hook_error = self.hook_error, None
        if err is not None:
            raise err

    def reset(self) -> None:
        """Forget residuals, momenta, reused thresholds and methods' runtime state
        (e.g. after loading a checkpoint)."""
        for group in self.groups:
            group.reset()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state as tensors and plain data (per-rank: save
        one per rank; see :mod:`sparcml.torch.checkpoint`). Call it between steps."""
        return {
            "version": CHECKPOINT_VERSION,
            # every setting that changes what is computed, and the parameters:
            # load_state_dict refuses another configuration (strict=True)
            "settings": self._checkpoint_settings(),
            "parameters": {n: list(s) for n, s in self.param_shapes.items()},
            "method": self.method,
            "density": describe_schedule(getattr(self.config, "density", None)),
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "step_bytes": list(self.step_bytes),
            # the collective call number: quantizers' rounding seeds derive from it
            "comm_sequence": self.comm.sequence,
            "layout": [list(k) for k in self.layout],
            **_group_dict(self.groups[0]),
            "groups": [_group_dict(g) for g in self.groups[1:]],
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
                world size or rank is refused either way. Checkpoints of version 2
                (method options named ``oktopk_tau``, ``redsync_asq``, ...) load with
                their names translated; version 1 (before settings were saved) loads
                with a warning that nothing could be checked.

        Raises:
            ValueError: a setting, the parameters, the world size or the rank differ.
        """
        sd = state_dict
        mine = (self.comm.world_size, self.comm.rank)
        theirs = (sd["world_size"], sd["rank"])
        if mine != theirs:
            raise ValueError(
                f"sparcml checkpoint of (world size, rank) = {theirs}, this state is {mine}"
            )
        version = int(sd.get("version", 1))
        if version > CHECKPOINT_VERSION:
            raise ValueError(
                f"sparcml checkpoint of format version {version}: this sparcml reads "
                f"versions 1-{CHECKPOINT_VERSION}; upgrade sparcml to load it"
            )
        saved = sd.get("settings")
        if saved is None:
            takes_density = "density" in method_spec(sd["method"]).config.field_names()
            old = {"method": sd["method"], "density": sd["density"] if takes_density else None}
            now = {
                "method": self.method,
                "density": describe_schedule(getattr(self.config, "density", None)),
            }
            differ = _check_settings(old, now, strict)
            log.warning("sparcml checkpoint of version %s carries no settings: only its "
                        "method and density could be checked", sd.get("version"))  # fmt: skip
        else:
            if version < 3:
                saved = _v2_settings(saved)
            differ = _check_settings(saved, self._checkpoint_settings(), strict)
        groups = sd.get("groups", [])
        if len(groups) != len(self.groups) - 1:  # (checked before anything is assigned)
            raise ValueError(
                f"sparcml checkpoint with {len(groups)} layer rule groups, this state has "
                f"{len(self.groups) - 1}"
            )
        params = {n: tuple(v) for n, v in sd.get("parameters", {}).items()}
        if params and strict:
            if self.param_shapes:
                _check_parameters(params, self.param_shapes)
            else:  # checked when the model is registered (set_parameters)
                self.checkpoint_parameters = params
        self.step = int(sd["step"])
        self.bytes_sent = int(sd["bytes_sent"])
        self.step_bytes = [int(b) for b in sd["step_bytes"]]
        self.comm.sequence = int(sd["comm_sequence"])
        self.layout = [tuple(k) for k in sd["layout"]]
        self.replay_layout = list(self.layout) or None
        for group, group_sd in zip(self.groups, [sd, *groups], strict=True):
            # (other settings: the saved operators, another method's or options', are
            # not this state's: a loaded natural operator under qsgd stayed natural)
            _load_group(group, group_sd, methods=not differ)

    def __repr__(self) -> str:
        return (
            f"SparcmlState(config={self.config!r}, settings={self.settings!r}, "
            f"layers={len(self.rules)}, step={self.step}, world_size={self.comm.world_size})"
        )


def checked_locally(
    method: str | MethodConfig,
    options: Mapping[str, Any],
    check: Callable[[SparcmlState], None] | None = None,
) -> SparcmlState:
    """A state of these arguments on a world of one (nothing collective), to check
    them where the real state is built later (PyTorch's ``(state, hook)`` pair) or
    must pass more checks first (FSDP2's limits, ``check``). A refusal is noted for
    the ranks that build theirs (:func:`~.construction.note_refusal`), unless the
    options name their own communicator."""
    local = {k: v for k, v in options.items() if k not in ("comm", "timeout")}
    with noting_refusal(options.get("comm") is None):
        probe = SparcmlState(method, comm=SelfCommunicator(), **local)
        if check is not None:
            check(probe)
    return probe


def _validated(
    method: str | MethodConfig,
    density: Density | None,
    settings: PipelineSettings | None,
    layers: Sequence[LayerRule | tuple[str, str]] | None,
    dense_below: int,
    options: dict[str, Any],
) -> tuple[PipelineSettings, list[LayerRule], list[MethodConfig]]:
    """A state's arguments checked and resolved: the pipeline settings, the layer
    rules, and the configs (the method's first, then each rule's; ValueError /
    TypeError naming what is wrong)."""
    pipeline = {k: options.pop(k) for k in PipelineSettings.names() if k in options}
    if settings is not None and pipeline:
        raise ValueError(
            f"give the pipeline settings as settings= or as keywords, not both "
            f"({', '.join(sorted(pipeline))})"
        )
    if settings is None:
        settings = PipelineSettings(**pipeline)
    extra = (*PipelineSettings.names(), "layers", "dense_below", "comm", "timeout")
    config = config_of(method, density, options, extra)
    spec = method_spec(config)
    if settings.momentum and spec.unbiased:
        # (a rule's unbiased method under a momentum-corrected state runs dense
        # momentum SGD: u = m u + g, sent whole, as warm-up steps do)
        raise ValueError(
            "momentum correction applies to sparse methods; use the optimizer's momentum"
        )
    rules = rules_from(layers, dense_below)
    inherited = getattr(config, "density", density)
    configs = [config] + [_rule_config(r, config, inherited) for r in rules]
    return settings, rules, configs


def _groups(
    configs: list[MethodConfig],
    settings: PipelineSettings,
    rules: list[LayerRule],
    comm: Communicator,
    names: dict[int, str],
) -> list[Group]:
    """The default group and one per layer rule."""
    return [Group(configs[0], settings, comm, "default", names, settings.error_feedback)] + [
        Group(c, settings, comm, r.name, names) for r, c in zip(rules, configs[1:], strict=True)
    ]


def _rule_config(rule: LayerRule, parent: MethodConfig, density: Density | None) -> MethodConfig:
    """A layer rule's config: the rule's method, density and options; the parent
    method's options that the rule's method also takes are inherited."""
    try:
        takes = set(method_spec(rule.method).config.field_names())
        inherited = {k: v for k, v in parent.options().items() if k in takes}
        d = density if rule.density is None else rule.density
        return config_of(rule.method, d, {**inherited, **dict(rule.options)})
    except (ValueError, TypeError) as e:
        raise type(e)(f"layer rule {rule.name!r}: {e}") from None


def _group_settings(group: Group, settings: PipelineSettings) -> dict[str, Any]:
    """One group's settings as plain data (the pipeline's, its method's)."""
    pipeline = dataclasses.asdict(settings)
    for volatile in ("stats_every", "stats_ranks", "error_feedback"):
        pipeline.pop(volatile)
    return {
        "method": group.config.name,
        "density": describe_schedule(getattr(group.config, "density", None)),
        "error_feedback": group.error_feedback,
        **pipeline,
        **group.config.settings(),
    }


def _group_dict(group: Group) -> dict[str, Any]:
    from . import checkpoint as ck

    return {
        "residuals": ck.tensors(group.feedback.buffers),
        "momenta": ck.tensors(group.momentum_correction.buffers),
        "operators": ck.keyed(group.operators),
        "method_state": ck.to_plain(group.method_state),
    }


def _load_group(group: Group, sd: dict[str, Any], methods: bool = True) -> None:
    """A group's residuals and momenta; its operators and method state too where
    ``methods`` (the checkpoint's settings are this state's)."""
    from . import checkpoint as ck

    group.feedback.buffers = ck.tensors(sd["residuals"])
    group.momentum_correction.buffers = ck.tensors(sd["momenta"])
    if not methods:
        group.operators = {}
        group.method_state = group.spec.runtime() if group.spec.runtime else None
        return
    group.operators = ck.unkeyed(sd["operators"])
    if "method_state" in sd:
        state = ck.from_plain(sd["method_state"])
    else:  # version 2: Ok-Topk's states and the aggregator's call counter by name
        state = group.spec.runtime() if group.spec.runtime else None
        if isinstance(state, dict):
            state.update(ck.unkeyed(sd.get("oktopk_states", [])))
        elif state is not None and hasattr(state, "calls"):
            state.calls = int(sd.get("ina_calls", 0))
    group.method_state = state


def _v2_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Version 2's settings with today's option names (and without the settings
    version 3 no longer compares)."""
    out = {_V2_NAMES.get(k, k): v for k, v in saved.items()}
    method = out.get("method")
    if isinstance(method, str) and "density" not in method_spec(method).config.field_names():
        out["density"] = None  # (version 2 recorded one for every method)
    for gone in ("ina_server", "server"):
        out.pop(gone, None)
    out["layers"] = [
        {
            **rule,
            "options": {_V2_NAMES.get(k, k): v for k, v in rule.get("options", {}).items()},
            "settings": _v2_settings(rule["settings"]),
        }
        for rule in out.get("layers", [])
    ]
    return out


def _in_effect(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings without those that change nothing: ``momentum_masking`` without
    momentum correction (so that checkpoints made before its default changed load
    where it never applied), ``index_coding`` (lossless: it changes the bytes on the
    wire, never the model; checkpoints made before its default became ``"auto"``
    load); the same for each layer rule's settings."""
    out = dict(settings)
    out.pop("index_coding", None)
    if not out.get("momentum"):
        out.pop("momentum_masking", None)
    if isinstance(out.get("layers"), list):
        out["layers"] = [
            {**r, "settings": _in_effect(r["settings"])}
            if isinstance(r, dict) and isinstance(r.get("settings"), dict)
            else r
            for r in out["layers"]
        ]
    return out


def _check_settings(saved: dict[str, Any], now: dict[str, Any], strict: bool) -> bool:
    """Refuse (``strict``) or log a checkpoint made with other settings (those in
    effect: :func:`_in_effect`); whether they differ."""
    saved, now = _in_effect(saved), _in_effect(now)
    diffs = [
        f"{k} (checkpoint: {saved.get(k)!r}, this state: {now.get(k)!r})"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if not diffs:
        return False
    text = "sparcml checkpoint made with other settings: " + "; ".join(diffs)
    if strict:
        raise ValueError(
            text + ". Build the state with the checkpoint's settings, or pass "
            "load_state_dict(..., strict=False) to load it anyway"
        )
    log.warning(
        "%s (loaded anyway: strict=False; residuals and momenta kept, the methods' "
        "operators and runtime state start afresh under this state's settings)",
        text,
    )
    return True


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
