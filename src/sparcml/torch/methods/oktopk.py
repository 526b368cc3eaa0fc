"""``oktopk``: Ok-Topk SGD (paper 001), lines 5-6: ``u, indexes = Ok_sparse_allreduce(acc)``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...collectives import OkTopkState, oktopk_allreduce
from ...compress.selection import k_of
from ...stream import SparseStream
from ..rules import Density
from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = ["OKTOPK", "OkTopk"]


@dataclasses.dataclass(frozen=True)
class OkTopk(MethodConfig):
    """Ok-Topk SGD (paper 001).

    Example:
        >>> OkTopk(density=0.01, tau=64).tau_prime
        32

    Attributes:
        density: fraction of each bucket's entries selected locally and kept
            globally (``k``), or a schedule.
        tau: calls between re-estimations of the region boundaries (tau).
        tau_prime: calls between exact threshold refreshes (tau').
    """

    density: Density = 0.01
    tau: int = 64
    tau_prime: int = 32

    def validate(self) -> None:
        OkTopkState(tau=self.tau, tau_prime=self.tau_prime)  # validates them


def run(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    cfg = group.config
    assert isinstance(cfg, OkTopk)
    states: dict[tuple[str, ...], OkTopkState] = group.method_state
    st = states.get(bucket.key)
    if st is None:
        st = states[bucket.key] = OkTopkState(tau=cfg.tau, tau_prime=cfg.tau_prime)
    result = oktopk_allreduce(acc, k_of(group.density, acc.numel()), group.comm, st)
    idx = result.local_indices
    sent = SparseStream.from_sorted(idx, acc[idx], acc.numel())
    return MethodResult(sent, result.stream.to_dense())


OKTOPK = register_method(
    MethodSpec(
        "oktopk",
        "Ok-Topk SGD: O(k) sparse allreduce with global top-k (paper 001)",
        run,
        config=OkTopk,
        names=("oktopk",),
        runtime=dict,  # an OkTopkState per bucket (its thresholds and regions)
    )
)
