"""``natural_ina``: paper 004 Alg. 1 with in-network aggregation.

Workers send C_nat(g_i) as integers, the aggregator (``sparcml ina-server``) sums
them and returns C_nat(sum) (master-side compression). The first call agrees on
the session (a random token, and a MAC key with ``secret``) through the
process group: a collective, in the same order on every rank like every bucket.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method

log = logging.getLogger("sparcml")

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = ["NATURAL_INA", "InaRuntime", "NaturalIna"]


@dataclasses.dataclass(frozen=True)
class NaturalIna(MethodConfig):
    """Natural compression summed by an integer-only aggregator.

    Example:
        >>> NaturalIna(server="127.0.0.1:9000").address
        ('127.0.0.1', 9000)

    Attributes:
        server: the aggregator's ``"host:port"`` (required).
        job: a label mixed into the rounding seed (jobs on one aggregator are told
            apart by the session the ranks agree on, not by this number).
        mode: ``"natural"`` (8-bit codes) or ``"fixed"`` (int32 fixed point).
        secret: the aggregator's secret (1..64 bytes, the same on every rank):
            every packet is then tagged with a per-session key (docs/ina.md).
    """

    server: str | None = None
    job: int = 1
    mode: str = "natural"
    secret: bytes | None = None

    def validate(self) -> None:
        if not self.server:
            raise ValueError("natural_ina needs server='host:port' (start one: sparcml ina-server)")
        host, _, port = self.server.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"server must be 'host:port', got {self.server!r}")
        if self.mode not in ("natural", "fixed"):
            raise ValueError(f"mode must be 'natural' or 'fixed', got {self.mode!r}")
        if self.secret is not None and not 1 <= len(self.secret) <= 64:
            raise ValueError(f"secret must be 1..64 bytes, got {len(self.secret)}")

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, _, port = self.server.rpartition(":")
        return host, int(port)


@dataclasses.dataclass
class InaRuntime:
    """A group's aggregator session (agreed at its first call) and call counter."""

    session: Any = None
    calls: int = 0
    clipped: int = 0  # values clipped to the format's top so far (this process)
    warned: bool = False

    def checkpoint_fields(self) -> dict[str, Any]:
        """What a checkpoint keeps: the call counter, not the session. The aggregator
        binds results to (session, call): a rewound counter in the same session would
        reuse call numbers, so a resumed run agrees a new session at its next call."""
        return {"session": None, "calls": self.calls}


def run(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    from ...ina import InaStats, agree_session, ina_allreduce

    cfg = group.config
    assert isinstance(cfg, NaturalIna)
    comm = group.comm
    rt: InaRuntime = group.method_state
    if rt.session is None:
        rt.session = agree_session(comm, cfg.mode, cfg.secret)
    stats = InaStats()
    call = rt.calls
    rt.calls += 1
    total = ina_allreduce(
        acc, cfg.address, rt.session, comm.rank, comm.world_size, cfg.mode,
        job=cfg.job, seed=group.settings.seed, call=call, timeout=comm.timeout, stats=stats,
    )  # fmt: skip
    comm.stats.bytes_sent += stats.bytes_sent  # counted like every method's traffic
    if stats.clipped:
        # |g| beyond the 8-bit format's top for this many workers (2^(12 - log2 P) at
        # e_min = -50) is sent as that top: biased; said, not hidden
        rt.clipped += stats.clipped
        if not rt.warned:
            rt.warned = True
            log.warning(
                "natural_ina: %d gradient values of bucket %s beyond the 8-bit format's "
                "range for %d workers were clipped (biased); scale the loss down or use "
                "'natural'", stats.clipped, ",".join(bucket.names[:3]), comm.world_size,
            )  # fmt: skip
    return MethodResult(None, total)


NATURAL_INA = register_method(
    MethodSpec(
        "natural_ina",
        "natural compression summed by an integer-only aggregator (sparcml ina-server) "
        "that re-compresses the sum: bidirectional compression (paper 004 Alg. 1, "
        "appendix A); needs server='host:port'",
        run,
        config=NaturalIna,
        names=("natural_ina",),
        unbiased=True,
        runtime=InaRuntime,
    )
)
