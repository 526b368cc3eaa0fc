"""``oktopk``: Ok-Topk SGD (paper 001), lines 5-6: ``u, indexes = Ok_sparse_allreduce(acc)``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...collectives import OkTopkState, oktopk_allreduce
from ...stream import SparseStream
from .base import MethodConfig, MethodSpec, register_method

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = ["OKTOPK", "OkTopkConfig"]


@dataclasses.dataclass
class OkTopkConfig(MethodConfig):
    """Attributes:
    oktopk_tau: calls between re-estimations of the region boundaries (tau).
    oktopk_tau_prime: calls between exact threshold refreshes (tau').
    """

    oktopk_tau: int = 64
    oktopk_tau_prime: int = 32

    def validate(self, method: str) -> None:
        OkTopkState(tau=self.oktopk_tau, tau_prime=self.oktopk_tau_prime)  # validates them


def run(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    k = min(acc.numel(), max(1, round(state.density * acc.numel())))  # as the selectors count
    result = oktopk_allreduce(acc, k, state.comm, state.oktopk_state(bucket.key))
    idx = result.local_indices
    sent = SparseStream.from_sorted(idx, acc[idx], acc.numel())
    return sent, result.stream.to_dense()


OKTOPK = register_method(
    MethodSpec(
        "oktopk",
        "Ok-Topk SGD: O(k) sparse allreduce with global top-k (paper 001)",
        run,
        config=OkTopkConfig,
        names=("oktopk",),
    )
)
