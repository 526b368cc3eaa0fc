"""Merging sorted runs of indices: the summation kernel of sparse streams.

Every sparse sum in the library adds streams whose indices are already sorted
and unique (the pieces of one index range in a split phase, two partial sums in
recursive doubling). Sorting their concatenation again costs ``O(K log K)``
with a large constant; a merge is linear. :func:`merge_sum` returns the sorted
union of the runs and the values summed **in run order** (run 0's value, plus
run 1's, ...), so the bits are the same on every rank and every run.

Values are accumulated into a scratch of ``-0.0`` (the identity of IEEE addition:
``-0.0 + x`` is ``x`` for every ``x``, ``+0.0`` and ``-0.0`` included), so a value
present in one run is carried bit for bit, explicitly stored zeros included,
and NaN/Inf propagate as in a dense sum.

One implementation per device:

* CPU: a compiled linear merge (numba, ``nogil``: in-process ranks merge in
  parallel) computes each input's position in the union; ``index_add_`` adds the
  values run by run;
* other devices (CUDA): torch ops (a stable sort of the concatenation, then
  ``unique_consecutive``), the same positions and the same run-by-run adds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["merge_positions", "merge_sum"]

_lock = threading.Lock()
_kernels: dict[str, Callable[..., Any]] = {}


def _compiled() -> dict[str, Callable[..., Any]]:
    """The CPU kernels, compiled on first use (cached on disk by numba)."""
    if _kernels:
        return _kernels
    with _lock:
        if _kernels:
            return _kernels
        import numba  # a declared dependency; imported lazily (compilation takes a moment)
        import numpy as np

        @numba.njit(cache=True, nogil=True)
        def merge2(a: Any, b: Any, pos: Any, union: Any) -> int:  # pragma: no cover - compiled
            la, lb = a.shape[0], b.shape[0]
            i = j = n = 0
            while i < la and j < lb:
                x, y = a[i], b[j]
                if x < y:
                    union[n] = x
                    pos[i] = n
                    i += 1
                elif y < x:
                    union[n] = y
                    pos[la + j] = n
                    j += 1
                else:
                    union[n] = x
                    pos[i] = n
                    pos[la + j] = n
                    i += 1
                    j += 1
                n += 1
            while i < la:
                union[n] = a[i]
                pos[i] = n
                i += 1
                n += 1
            while j < lb:
                union[n] = b[j]
                pos[la + j] = n
                j += 1
                n += 1
            return n

        @numba.njit(cache=True, nogil=True)
        def merge_k(idx: Any, offsets: Any, pos: Any, union: Any) -> int:  # pragma: no cover
            p = offsets.shape[0] - 1
            heads = offsets[:-1].copy()
            big = np.iinfo(np.int64).max
            n = 0
            while True:
                m = big
                for r in range(p):
                    h = heads[r]
                    if h < offsets[r + 1] and idx[h] < m:
                        m = idx[h]
                if m == big:
                    break
                for r in range(p):
                    h = heads[r]
                    if h < offsets[r + 1] and idx[h] == m:
                        pos[h] = n
                        heads[r] = h + 1
                union[n] = m
                n += 1
            return n

        _kernels["merge2"] = merge2
        _kernels["merge_k"] = merge_k
    return _kernels


def merge_positions(runs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted union of sorted, unique int64 runs, and where each input lands in it.

    Args:
        runs: 1-D int64 tensors on one device, each strictly increasing (unchecked).

    Returns:
        ``(union, pos)``: ``union`` strictly increasing; ``pos`` (one entry per
        input, runs concatenated) the position of each input index in ``union``.

    Example:
        >>> u, p = merge_positions([torch.tensor([1, 5]), torch.tensor([2, 5])])
        >>> u.tolist(), p.tolist()
        ([1, 2, 5], [0, 2, 1, 2])
    """
    device = runs[0].device
    total = sum(r.numel() for r in runs)
    if device.type != "cpu":
        cat = torch.cat(list(runs))
        order = torch.argsort(cat, stable=True)
        union, inverse = torch.unique_consecutive(cat[order], return_inverse=True)
        pos = torch.empty_like(inverse)
        pos[order] = inverse
        return union, pos
    k = _compiled()
    pos = torch.empty(total, dtype=torch.int64)
    union = torch.empty(total, dtype=torch.int64)
    runs = [r.contiguous() for r in runs]
    if len(runs) == 2:
        n = k["merge2"](runs[0].numpy(), runs[1].numpy(), pos.numpy(), union.numpy())
    else:
        offsets = torch.tensor([0, *(r.numel() for r in runs)], dtype=torch.int64).cumsum(0)
        cat = torch.cat(runs)
        n = k["merge_k"](cat.numpy(), offsets.numpy(), pos.numpy(), union.numpy())
    return union[:n], pos


def merge_sum(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of sparse runs ``(indices[r], values[r])``, added in run order (see module doc).

    Example:
        >>> i, v = merge_sum([torch.tensor([1, 5]), torch.tensor([5])],
        ...                  [torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
        >>> i.tolist(), v.tolist()
        ([1, 5], [1.0, 5.0])
    """
    union, pos = merge_positions(indices)
    out = torch.full((union.numel(),), -0.0, dtype=values[0].dtype, device=union.device)
    start = 0
    for v in values:
        n = v.numel()
        if n:
            out.index_add_(0, pos[start : start + n], v)
        start += n
    return union, out
