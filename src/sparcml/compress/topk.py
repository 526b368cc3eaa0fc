"""Exact top-k by magnitude (paper 000 sec. 2.2, "Top-k SGD")."""

from __future__ import annotations

import torch

from ..stream import SparseStream
from .base import Selector, check_input, register
from .selection import KSpec, scratch_magnitude, stream_of
from .threshold_reuse import BRACKET_MIN, top_k_exact, top_k_exact_checked

__all__ = ["TopK"]


@register("topk")
class TopK(Selector):
    """The ``k`` entries of largest magnitude (NaN counts as largest).

    Large tensors on the CPU (``2^16`` entries and more): the exact k-th largest magnitude
    ``t`` and every entry above it, then the first entries equal to ``t`` in index
    order, by :func:`~.threshold_reuse.top_k_exact` (a bracketed search, in one pass
    over float32/float64 entries, faster than ``torch.topk`` on large CPU tensors);
    small ones or tensors on a GPU (where ``torch.topk`` measured faster:
    docs/benchmarks.md, "On a GPU"): ``torch.topk``.
    Either way ``k`` entries of the largest magnitudes, except that on the CPU a
    tensor with fewer than ``k`` non-zeros gives its non-zeros only: the zeros a
    top-k would add change no sum and no residual (``acc - TopK(acc)`` is the same),
    and cost bytes and a second search. On a GPU they stay: leaving them out would
    cost a device sync per call to learn their count. (Beyond paper 000 sec. 2.2,
    which selects ``k`` entries of dense gradients; sparse-feature layers such as
    hashed bag-of-words or embedding inputs have fewer non-zeros than ``k``.)

    Args:
        k: number of entries, or
        density: fraction of entries (exactly one of the two).

    Example:
        >>> TopK(k=2).select(torch.tensor([0.1, -3.0, 2.0, 0.5])).indices.tolist()
        [1, 2]
    """

    stateless = True

    def __init__(self, k: int | None = None, density: float | None = None) -> None:
        self.spec = KSpec(k, density, "topk")
        self.k, self.density = k, density

    def select(self, tensor: torch.Tensor) -> SparseStream:
        return self.select_checked(tensor)[0]

    def select_covering(self, tensor: torch.Tensor) -> tuple[SparseStream, bool]:
        """:meth:`select`; on the CPU, fewer than ``k`` entries are the non-zeros, all
        of them (a top-k that reached zeros). On a GPU the zeros stay: never known."""
        selected, covering, _ = self.select_checked(tensor)
        return selected, covering

    def select_checked(self, tensor: torch.Tensor) -> tuple[SparseStream, bool, bool | None]:
        """:meth:`select_covering`, and whether ``tensor`` is finite where the one-pass
        search saw every entry that could be NaN or +-inf (its candidates:
        :func:`~.threshold_reuse.top_k_exact_checked`); None elsewhere."""
        x = check_input(tensor, self.name)
        k = self.spec.of(x.numel())
        finite = None
        # (the bracketed search reads counts back to the host at every step: on a GPU
        # torch.topk is faster, docs/benchmarks.md "On a GPU")
        if k and x.numel() >= BRACKET_MIN and x.device.type == "cpu":
            # (t = 0, fewer than k non-zeros: idx holds the non-zeros)
            _, idx, finite = top_k_exact_checked(x, k)
            selected = SparseStream.from_sorted(idx, x[idx], x.numel())
        else:
            idx = torch.topk(scratch_magnitude(x), k, sorted=False).indices
            if x.device.type == "cpu":  # (a mask's size on a GPU would cost a device sync)
                idx = idx[x[idx] != 0]  # (NaN != 0: kept)
            selected = stream_of(x, idx)
        covering = selected.device.type == "cpu" and selected.nnz < k
        return selected, covering, finite

    def select_entries(self, entries: SparseStream) -> tuple[SparseStream, bool]:
        """:meth:`select_covering` of the vector whose non-zeros are ``entries`` (a
        sorted sparse stream, without zeros; NaN and infinities are entries), from the
        entries alone: O(nnz) instead of a pass over ``entries.size``.

        Fewer than ``k`` entries: all of them (covering, as on the CPU). Otherwise
        :func:`~.threshold_reuse.top_k_exact` of their values, whose order (magnitude,
        ties at the ``k``-th broken by position) is the dense vector's, since the
        entries keep the vector's order. So on the CPU, for ``entries.size`` of at
        least ``BRACKET_MIN`` (where :meth:`select` takes ``top_k_exact`` too), the
        bits of ``select_covering(entries.to_dense())``; below it ``select`` takes
        ``torch.topk``, whose choice among ties at the ``k``-th magnitude is its own.
        (Beyond paper 000 sec. 2.2: a sparse gradient's accumulator, whose dense
        form is mostly zeros, selected without densifying.)

        Example:
            >>> s = SparseStream.from_sorted(torch.tensor([3, 9, 70]),
            ...                              torch.tensor([1.0, -5.0, 2.0]), 100)
            >>> sel, covering = TopK(k=2).select_entries(s)
            >>> sel.indices.tolist(), covering
            ([9, 70], False)
        """
        k = self.spec.of(entries.size)
        if entries.nnz < k or entries.nnz == 0:
            return entries, entries.nnz < k
        _, pos = top_k_exact(entries.values, k)
        chosen = SparseStream.from_sorted(entries.indices[pos], entries.values[pos], entries.size)
        return chosen, False

    def takes_all_nonzeros(self, nonzeros: int, numel: int) -> bool:
        """Fewer non-zeros than ``k``: a top-k takes them all."""
        return nonzeros < self.spec.of(numel)
