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

* CPU: compiled kernels (numba, ``nogil``: in-process ranks merge in parallel)
  compute each input's position in the union: two runs by a linear merge (of
  float32/float64 values: merged and added in the same pass); more
  runs, when they span at most 64 positions per entry (a split phase's pieces of
  one range), by a bitmap of the span (set a bit per entry, read the union off
  the set bits, each position = the set bits before it; cache-resident, and no
  scan of every run's head per entry as in a k-way merge), else by a k-way merge;
  ``index_add_`` adds the values run by run;
* other devices (CUDA): torch ops (a stable sort of the concatenation, then
  ``unique_consecutive``), the same positions and the same run-by-run adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kernels import compiled

__all__ = ["merge_positions", "merge_sum"]

#: value dtypes whose two-run sums the CPU merges and adds in one compiled pass
_FUSED = (torch.float32, torch.float64)


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
    k = compiled()
    pos = torch.empty(total, dtype=torch.int64)
    union = torch.empty(total, dtype=torch.int64)
    runs = [r.contiguous() for r in runs]
    if len(runs) == 2:
        n = k.merge2(runs[0].numpy(), runs[1].numpy(), pos.numpy(), union.numpy())
    else:
        cat = torch.cat(runs)
        full = [r for r in runs if r.numel()]
        lo = min(int(r[0]) for r in full) if full else 0
        width = max(int(r[-1]) for r in full) - lo + 1 if full else 0
        if width <= 64 * total:
            # a bitmap of the covered span (at most one word per input entry)
            n = k.merge_bitmap(cat.numpy(), lo, width, pos.numpy(), union.numpy())
        else:
            offsets = torch.tensor([0, *(r.numel() for r in runs)], dtype=torch.int64).cumsum(0)
            n = k.merge_k(cat.numpy(), offsets.numpy(), pos.numpy(), union.numpy())
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
    if (
        len(indices) == 2
        and indices[0].device.type == "cpu"
        and values[0].dtype in _FUSED
        and values[1].dtype == values[0].dtype
    ):
        return _merge2_sum(indices, values)
    union, pos = merge_positions(indices)
    out = torch.full((union.numel(),), -0.0, dtype=values[0].dtype, device=union.device)
    start = 0
    for v in values:
        n = v.numel()
        if n:
            out.index_add_(0, pos[start : start + n], v)
        start += n
    return union, out


def _merge2_sum(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two CPU runs merged and added in one pass (``cpu_kernels.merge2_sum``): the
    union and the sums :func:`merge_sum` gives, bit for bit, without the positions
    array and the two ``index_add_`` passes (``benchmarks/merge_fused.py``: 0.90 -> 0.52 ms
    for two runs of 65k entries)."""
    a, b = (r.contiguous() for r in indices)
    av, bv = (v.contiguous() for v in values)
    total = a.numel() + b.numel()
    union = torch.empty(total, dtype=torch.int64)
    out = torch.empty(total, dtype=av.dtype)
    neg0 = torch.full((1,), -0.0, dtype=av.dtype)
    n = compiled().merge2_sum(
        a.numpy(), av.numpy(), b.numpy(), bv.numpy(), union.numpy(), out.numpy(), neg0.numpy()
    )
    return union[:n], out[:n]
