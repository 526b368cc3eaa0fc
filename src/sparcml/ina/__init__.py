"""In-network aggregation with natural compression (paper 004 sec. 5 and appendix A).

An integer-only aggregator (:class:`AggregatorServer`, ``sparcml ina-server``) sums
workers' chunks of 8-bit natural-compression codes (restored to integers by
shifts) or fixed-point integers, re-compresses the sum and sends it back;
:func:`ina_allreduce` is the worker side with loss recovery; :class:`LossyRelay`
injects loss, duplication and reordering between them.
"""

from __future__ import annotations

from .packet import PacketError, build, parse
from .relay import LossyRelay
from .server import AggregatorServer, natural_compress_integers
from .worker import AggregatorRestartedError, InaStats, ina_allreduce

__all__ = [
    "AggregatorRestartedError",
    "AggregatorServer",
    "InaStats",
    "LossyRelay",
    "PacketError",
    "build",
    "ina_allreduce",
    "natural_compress_integers",
    "parse",
]
