"""Checkpoint and resume of sparcml's per-rank compression state.

Everything that determines a method's future steps lives on the
:class:`~sparcml.torch.SparcmlState` (for the DDP hook, sync_gradients and FSDP2 alike):
error-feedback residuals and DGC momenta, the per-bucket selectors and quantizers
(threshold reuse thresholds and call counters, sampled binary-search thresholds,
ASQ's sign parity, random-k call counters, quantizers' random generators), Ok-Topk's
reused thresholds and boundaries, RedSync's per-layer operators, the step counter,
the traffic counters and the INA call counter. Restoring model and optimizer alone
loses all of it: a resumed top-k run then differs from the uninterrupted one (the
residuals restart at zero). The SparCML paper (000, Alg. 1) keeps the residual
``eps_t`` across steps but says nothing about checkpoints; this module is beyond it.

``state_dict()`` holds only tensors and plain data (dicts with string keys, lists,
str, int, float, bool, None), so it passes ``torch.save`` / ``torch.load(...,
weights_only=True)``. It is **per-rank** data (each rank's residuals differ): save
one file per rank::

    torch.save(state.state_dict(), f"ckpt/sparcml-rank{rank}.pt")
    ...
    state.load_state_dict(torch.load(f"ckpt/sparcml-rank{rank}.pt"))

or, with ``torch.distributed.checkpoint``, under a rank-keyed entry (see
:func:`dcp_entry` / :func:`load_dcp_entry`): DCP deduplicates equal keys across
ranks, so per-rank data must have per-rank keys.

Operators are stored as their class (restricted to ``sparcml.*`` classes on load)
and their attributes, rebuilt without calling the constructor, so every counter,
threshold and generator state comes back exactly.
"""

from __future__ import annotations

import importlib
import io
from typing import Any

import torch

__all__ = ["dcp_entry", "from_plain", "load_dcp_entry", "to_plain"]

_OBJ, _GEN, _DEV, _PAIRS, _TUPLE = (
    "__object__",
    "__generator__",
    "__device__",
    "__pairs__",
    "__tuple__",
)


def to_plain(value: Any) -> Any:
    """``value`` as tensors and plain data (operators, generators, devices included)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        return {_GEN: str(value.device), "state": value.get_state()}
    if isinstance(value, torch.device):
        return {_DEV: str(value)}
    if isinstance(value, tuple):
        return {_TUPLE: [to_plain(v) for v in value]}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_plain(v) for k, v in value.items()}
        return {_PAIRS: [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    cls = type(value)
    if cls.__module__.startswith("sparcml.") and hasattr(value, "__dict__"):
        # an object may say what a checkpoint keeps of it (checkpoint_fields())
        kept = value.checkpoint_fields() if hasattr(value, "checkpoint_fields") else vars(value)
        fields = {k: to_plain(v) for k, v in kept.items()}
        return {_OBJ: f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(f"cannot checkpoint a {cls.__module__}.{cls.__qualname__}")


def _class(path: str) -> type:
    module, _, qualname = path.partition(":")
    if not module.startswith("sparcml."):
        raise ValueError(f"refusing to rebuild {path!r}: only sparcml classes are restored")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{path!r} is not a class")
    return obj


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    if _GEN in value:
        g = torch.Generator(device=value[_GEN])
        g.set_state(value["state"])
        return g
    if _DEV in value:
        return torch.device(value[_DEV])
    if _TUPLE in value:
        return tuple(from_plain(v) for v in value[_TUPLE])
    if _PAIRS in value:
        return {from_plain(k): from_plain(v) for k, v in value[_PAIRS]}
    if _OBJ in value:
        cls = _class(value[_OBJ])
        obj = cls.__new__(cls)
        obj.__dict__.update({k: from_plain(v) for k, v in value["fields"].items()})
        return obj
    return {k: from_plain(v) for k, v in value.items()}


def keyed(store: dict[tuple[str, ...], Any]) -> list[dict[str, Any]]:
    """A dict with tuple-of-name keys as a list of ``{"key": [...], "value": ...}``."""
    return [{"key": list(k), "value": to_plain(v)} for k, v in store.items()]


def unkeyed(rows: list[dict[str, Any]]) -> dict[tuple[str, ...], Any]:
    return {tuple(row["key"]): from_plain(row["value"]) for row in rows}


def tensors(store: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in store.items()}


def dcp_entry(state: Any, rank: int) -> dict[str, Any]:
    """A ``torch.distributed.checkpoint`` entry holding one rank's sparcml state.

    Returns ``{"sparcml_rank{rank}": io.BytesIO(...)}``: merge it into the state dict
    given to ``dcp.save`` on each rank (DCP stores ``BytesIO`` values as they are,
    and every rank's key differs, so no rank's state is deduplicated away)::

        sd = {"model": model.state_dict(), **sparcml.torch.checkpoint.dcp_entry(state, rank)}
        dcp.save(sd, checkpoint_id=path)
        ...
        sd = {"model": model.state_dict(), **dcp_entry(state, rank)}  # same keys
        dcp.load(sd, checkpoint_id=path)
        sparcml.torch.checkpoint.load_dcp_entry(state, sd, rank)
    """
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    return {f"sparcml_rank{rank}": buf}


def load_dcp_entry(state: Any, loaded: dict[str, Any], rank: int) -> None:
    """Restore ``state`` from the entry :func:`dcp_entry` made, after ``dcp.load``."""
    buf = loaded[f"sparcml_rank{rank}"]
    buf.seek(0)
    state.load_state_dict(torch.load(buf, weights_only=True))
