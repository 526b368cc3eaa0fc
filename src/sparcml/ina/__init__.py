"""In-network aggregation with natural compression (paper 004 sec. 5 and appendix A).

An integer-only aggregator (:class:`AggregatorServer`, ``sparcml ina-server``) sums
workers' chunks of 8-bit natural-compression codes (restored to integers by
shifts) or fixed-point integers, re-compresses the sum and sends it back;
:func:`ina_allreduce` is the worker side with loss recovery; :class:`LossyRelay`
injects loss, duplication and reordering between them. A job is a session
(:class:`InaSession`: a random token the workers agree on through their process
group, optionally with a MAC key), and the aggregator's state is bounded.
"""

from __future__ import annotations

from .packet import PacketError, build, parse
from .relay import LossyRelay
from .server import AggregatorServer, natural_compress_integers
from .session import InaSession, agree_session
from .worker import AggregatorRefusedError, AggregatorRestartedError, InaStats, ina_allreduce

__all__ = [
    "AggregatorRefusedError",
    "AggregatorRestartedError",
    "AggregatorServer",
    "InaSession",
    "InaStats",
    "LossyRelay",
    "PacketError",
    "agree_session",
    "build",
    "ina_allreduce",
    "natural_compress_integers",
    "parse",
]
