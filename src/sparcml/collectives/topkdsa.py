"""TopkDSA: SparCML's split allgather with the dynamic switch to dense (paper 001's name).

Ok-Topk's slides call SparCML's dynamic sparse allreduce "TopkDSA": the split
phase sends each range to its owner, the owner reduces it, and the sparse
allgather carries the reduced ranges, each switching to dense past ``delta``.
That is exactly :func:`~sparcml.collectives.ssar_split_allgather.ssar_split_allgather`
(whose streams switch representation by themselves), registered again under this
name.

Bandwidth ``[4k (P-1)/P, (2k + n)(P-1)/P] beta``.
"""

from __future__ import annotations

from .registry import register
from .ssar_split_allgather import cost, ssar_split_allgather

__all__ = ["topkdsa"]

topkdsa = register("topkdsa", input="selection", cost=cost, quadratic=True, family=("topk",))(
    ssar_split_allgather
)
