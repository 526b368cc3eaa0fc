"""DDP bucket layouts across a checkpoint: record them, replay them after a resume.

A selector works on a whole bucket (top-k of the bucket's accumulated gradient),
so the result depends on how DDP groups parameters into buckets. DDP's first
iteration after construction puts every parameter in one bucket (torch 2.13,
without ``find_unused_parameters``) and rebuilds the buckets in gradient-ready
order afterwards. A resumed run's first step would then select over another
layout than the uninterrupted run at that step and drift from it.

So the hook records the layout of every step (the bucket keys, in the order DDP
hands them over), the state's checkpoint keeps it, and after
``load_state_dict`` a DDP bucket that spans several recorded buckets is split
into them: each recorded bucket is reduced on its own, in the recorded order, and
the results are written back into DDP's bucket. Once DDP hands over recorded
buckets again (after its rebuild), nothing is split. A bucket that does not fit
the recorded layout is reduced as it is, with a warning (the run is then not
bitwise the uninterrupted one, but correct).
"""

from __future__ import annotations

import logging

import torch

from .reduce import Bucket, reduce_bucket, reduce_sparse_gradient
from .state import SparcmlState

__all__ = ["reduce_ddp_bucket"]

log = logging.getLogger(__name__)


def _record(state: SparcmlState, keys: list[tuple[str, ...]], is_last: bool) -> None:
    current = state.layout_now
    current.extend(keys)
    if is_last:
        state.layout = list(current)
        current.clear()


def reduce_ddp_bucket(state: SparcmlState, item: Bucket, is_last: bool) -> torch.Tensor:
    """:func:`reduce_bucket` of one DDP bucket, split into the recorded layout after
    a resume (see the module docstring). Runs on the state's engine, in order."""
    replay: list[tuple[str, ...]] | None = state.replay_layout
    if is_last:
        state.replay_layout = None  # one step: DDP rebuilds its buckets after it
    if item.grad.is_sparse:  # DDP gives a sparse gradient a bucket of its own
        _record(state, [item.names], is_last)
        return reduce_sparse_gradient(state, item)
    if not replay or item.names in replay:
        _record(state, [item.names], is_last)
        return reduce_bucket(state, item)
    where = {n: i for i, n in enumerate(item.names)}
    groups = [g for g in replay if all(n in where for n in g)]
    covered = {n for g in groups for n in g}
    if len(covered) != len(item.names) or sum(len(g) for g in groups) != len(covered):
        log.warning(
            "sparcml resume: a DDP bucket of %d parameters does not match the "
            "checkpoint's bucket layout; reduced as it is (correct, but not bitwise "
            "the uninterrupted run)",
            len(item.names),
        )
        _record(state, [item.names], is_last)
        return reduce_bucket(state, item)
    _record(state, groups, is_last)
    offsets = [0]
    for size in item.sizes:
        offsets.append(offsets[-1] + size)
    flat = item.grad.reshape(-1)
    out = torch.empty_like(flat)
    for g in groups:
        parts = [flat[offsets[where[n]] : offsets[where[n] + 1]] for n in g]
        sizes = tuple(p.numel() for p in parts)
        avg = reduce_bucket(state, Bucket(g, sizes, torch.cat(parts), item.step))
        for n, part in zip(g, avg.split(list(sizes)), strict=True):
            out[offsets[where[n]] : offsets[where[n] + 1]] = part
    return out
