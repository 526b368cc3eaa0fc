"""``natural_ina``: paper 004 Alg. 1 with in-network aggregation.

Workers send C_nat(g_i) as integers, the aggregator (``sparcml ina-server``) sums
them and returns C_nat(sum) (master-side compression). The first call agrees on
the session (a random token, and a MAC key with ``ina_secret``) through the
process group: a collective, in the same order on every rank like every bucket.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .base import MethodConfig, MethodSpec, register_method

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = ["NATURAL_INA", "InaConfig"]


@dataclasses.dataclass
class InaConfig(MethodConfig):
    """Attributes:
    ina_server: the aggregator's ``"host:port"`` (required).
    ina_job: a label mixed into the rounding seed (jobs on one aggregator are told
        apart by the session the ranks agree on, not by this number).
    ina_mode: ``"natural"`` (8-bit codes) or ``"fixed"`` (int32 fixed point).
    ina_secret: the aggregator's secret (1..64 bytes, the same on every rank):
        every packet is then tagged with a per-session key (docs/ina.md).
    """

    ina_server: str | None = None
    ina_job: int = 1
    ina_mode: str = "natural"
    ina_secret: bytes | None = None

    def validate(self, method: str) -> None:
        if not self.ina_server:
            raise ValueError(
                "natural_ina needs ina_server='host:port' (start one: sparcml ina-server)"
            )
        host, _, port = self.ina_server.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ina_server must be 'host:port', got {self.ina_server!r}")
        if self.ina_mode not in ("natural", "fixed"):
            raise ValueError(f"ina_mode must be 'natural' or 'fixed', got {self.ina_mode!r}")
        if self.ina_secret is not None and not 1 <= len(self.ina_secret) <= 64:
            raise ValueError(f"ina_secret must be 1..64 bytes, got {len(self.ina_secret)}")

    @property
    def address(self) -> tuple[str, int]:
        assert self.ina_server is not None
        host, _, port = self.ina_server.rpartition(":")
        return host, int(port)


def run(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    from ...ina import InaStats, agree_session, ina_allreduce

    cfg = state.config
    comm = state.comm
    if state.ina_session is None:
        state.ina_session = agree_session(comm, cfg.ina_mode, cfg.ina_secret)
    stats = InaStats()
    call = state.ina_calls
    state.ina_calls += 1
    total = ina_allreduce(
        acc, cfg.address, state.ina_session, comm.rank, comm.world_size, cfg.ina_mode,
        job=cfg.ina_job, seed=state.seed, call=call, timeout=comm.timeout, stats=stats,
    )  # fmt: skip
    comm.stats.bytes_sent += stats.bytes_sent  # counted like every method's traffic
    return None, total


NATURAL_INA = register_method(
    MethodSpec(
        "natural_ina",
        "natural compression summed by an integer-only aggregator (sparcml ina-server) "
        "that re-compresses the sum: bidirectional compression (paper 004 Alg. 1, "
        "appendix A); needs ina_server='host:port'",
        run,
        config=InaConfig,
        names=("natural_ina",),
        unbiased=True,
    )
)
