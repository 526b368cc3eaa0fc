"""Configuration as data: a mapping, a JSON file or a YAML file instead of keywords.

Every entry point that takes a method name also takes a config
(:func:`~sparcml.torch.register`, :func:`~sparcml.torch.register_fsdp`,
:func:`~sparcml.torch.comm_hook`, :meth:`SparcmlState.from_config
<sparcml.torch.SparcmlState.from_config>`, ``sparcml train --config FILE``). A config
holds the method and the keyword arguments of :class:`~sparcml.torch.SparcmlState`,
by the same names, and is checked by the same code, so it gets the same error
messages. What a file cannot hold has a data form:

* ``density``: a number, or a schedule ``{"warmup": {"steps_per_epoch": 100,
  "epochs": 4, "start": 0.25, "end": 0.001}}`` (:class:`~.rules.DensityWarmup`);
* ``layers``: a list of rules, each ``[pattern, method]`` or a mapping with the
  fields of :class:`~.rules.LayerRule` (``method``, ``pattern``, ``min_numel``,
  ``max_numel``, ``density``, ``options``, ``label``), its ``when`` written as
  ``steps: {"from": 0, "until": 1000}`` (:class:`~.rules.StepRange`);
* ``comm`` (a communicator object) has none: pass it as a keyword.

Example (YAML)::

    method: topk+natural
    density: 0.01
    momentum: 0.9
    warmup_steps: 100
    layers:
      - ["*.bias", dense]
      - {pattern: "embed.*", method: nonzeros}
      - {pattern: "fc.*", method: topk, density: 0.05, steps: {from: 0, until: 500}}

Example:
    >>> load_config({"method": "topk", "layers": [["*.bias", "dense"]]})["layers"]
    [LayerRule(method='dense', pattern='*.bias', min_numel=None, max_numel=None, \
density=None, when=None, options={}, label=None)]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .construction import noting_refusal
from .rules import DensityWarmup, LayerRule, StepRange

__all__ = [
    "CONFIG_SUFFIXES",
    "is_config",
    "load_config",
    "resolve_method",
    "resolved_or_noted",
    "state_or_method",
]

#: file name endings read as configs (a method name never ends so)
CONFIG_SUFFIXES = (".json", ".yaml", ".yml")

#: keyword arguments a config cannot carry (objects, not data)
_NOT_DATA = ("comm", "_parent", "state")
_RULE_KEYS = ("method", "pattern", "min_numel", "max_numel", "density", "steps", "options", "label")


def is_config(value: Any) -> bool:
    """Whether ``value`` is a config (a mapping, or the path of a JSON/YAML file),
    not a method name."""
    if isinstance(value, Mapping | os.PathLike):
        return True
    return isinstance(value, str) and value.lower().endswith(CONFIG_SUFFIXES)


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The :class:`~sparcml.torch.SparcmlState` keyword arguments a config stands for.

    Args:
        source: a mapping, or the path of a ``.json``, ``.yaml`` or ``.yml`` file.

    Returns:
        The keywords, ``method`` included when the config names one; density
        schedules and layer rules built from their data form.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file cannot be parsed, is not a mapping, or an entry is
            malformed (named: ``config.yaml: layers[1]: ...``); unknown options are
            refused by :class:`~sparcml.torch.SparcmlState`, as keywords are.
        TypeError: ``source`` is neither a mapping nor a path.
        ImportError: a YAML file without PyYAML installed.
    """
    if isinstance(source, Mapping):
        return _normalise(source, "config")
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"a config is a mapping or the path of a JSON/YAML file, got {type(source).__name__}"
        )
    path = Path(source)
    where = str(path)
    if path.suffix.lower() not in CONFIG_SUFFIXES:
        raise ValueError(f"{where}: a config file ends in {', '.join(CONFIG_SUFFIXES)}")
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such config file")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ImportError(
                f"{where}: reading a YAML config needs PyYAML (pip install 'sparcml[config]' "
                "or pip install pyyaml), or write the config as JSON"
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{where}: not valid YAML: {e}") from None
    return _normalise(raw, where)


def state_or_method(
    method: Any, state: Any, options: Mapping[str, Any]
) -> tuple[Any, dict[str, Any]] | None:
    """What an entry point (``register``, ``register_fsdp``) builds its state from:
    None when a ready ``state`` is given, else :func:`resolve_method` of ``method``
    (default ``"topk"``) and ``options``.

    Raises:
        ValueError: both a state and a method or options.
    """
    if state is not None:
        if method is not None or options:
            raise ValueError("give either a state or a method with its options, not both")
        return None
    return resolved_or_noted("topk" if method is None else method, options)


def resolved_or_noted(method: Any, options: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """:func:`resolve_method` where a state is to be built from it: a config this
    rank cannot read (a file missing on one node, malformed there) is noted as this
    rank's refusal (:func:`~sparcml.torch.construction.note_refusal`, unless the
    options name their own communicator), so the other ranks' states raise naming
    this rank at once instead of waiting out their timeout for it."""
    with noting_refusal(options.get("comm") is None):
        resolved = resolve_method(method, options)
    return resolved


def resolve_method(method: Any, options: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(method, options)`` for an entry point's ``method`` argument: a method name
    with its keyword options as given, or a config whose options the keywords
    override (``register(model, "cfg.yaml", density=0.05)``)."""
    if not is_config(method):
        return method, dict(options)
    kw = load_config(method)
    name = kw.pop("method", "topk")
    return name, {**kw, **options}


def _normalise(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where}: a config is a mapping of options (method, density, layers, ...), "
            f"got {type(raw).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: option names are strings, got {key!r}")
        if key in _NOT_DATA:
            raise ValueError(f"{where}: {key!r} cannot come from a config; pass it as a keyword")
        if key == "method" and not isinstance(value, str):
            raise ValueError(f"{where}: method must be a method name, got {value!r}")
        if key == "density":
            out[key] = _density(value, f"{where}: density")
        elif key == "layers":
            if not isinstance(value, list):
                raise ValueError(f"{where}: layers must be a list of rules, got {value!r}")
            out[key] = [_rule(r, f"{where}: layers[{i}]") for i, r in enumerate(value)]
        else:
            out[key] = value
    return out


def _density(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        if set(value) != {"warmup"} or not isinstance(value["warmup"], Mapping):
            raise ValueError(
                f"{where}: a number, or a schedule {{'warmup': {{'steps_per_epoch': ..., "
                f"'epochs': ..., 'start': ..., 'end': ...}}}}, got {dict(value)!r}"
            )
        try:
            return DensityWarmup(**value["warmup"])
        except TypeError as e:
            raise ValueError(f"{where}: warmup: {e}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: a number or a warmup schedule, got {value!r}")
    return value


def _rule(raw: Any, where: str) -> LayerRule:
    if isinstance(raw, list | tuple):
        if len(raw) != 2 or not all(isinstance(x, str) for x in raw):
            raise ValueError(f"{where}: a rule is [pattern, method] or a mapping, got {raw!r}")
        return LayerRule(raw[1], pattern=raw[0])
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a rule is [pattern, method] or a mapping, got {raw!r}")
    unknown = sorted(set(raw) - set(_RULE_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: unknown rule field(s) {', '.join(map(repr, unknown))}; "
            f"a rule has {', '.join(_RULE_KEYS)}"
        )
    if "method" not in raw:
        raise ValueError(f"{where}: a rule needs a method")
    fields = {k: v for k, v in raw.items() if k not in ("steps", "density")}
    if "density" in raw and raw["density"] is not None:
        fields["density"] = _density(raw["density"], f"{where}: density")
    if "options" in fields and not isinstance(fields["options"], Mapping):
        raise ValueError(f"{where}: options must be a mapping, got {fields['options']!r}")
    if "steps" in raw:
        steps = raw["steps"]
        if not isinstance(steps, Mapping) or not set(steps) <= {"from", "until"}:
            raise ValueError(
                f"{where}: steps is {{'from': first step, 'until': first step after}}, "
                f"got {steps!r}"
            )
        fields["when"] = StepRange(int(steps.get("from", 0)), _opt_int(steps.get("until")))
    try:
        return LayerRule(**fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
