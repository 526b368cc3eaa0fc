"""The alpha-beta(-gamma) cost model: parameters, calibration files, fill-in math.

Each algorithm's cost formula lives with the algorithm and is registered with it
(:mod:`sparcml.collectives.registry`: ``predict``, ``choose``); this module knows
no algorithm names.

Sending ``L`` bytes costs ``alpha + beta * L`` (paper 000, sec. 5.2, "Analytical
Model"; ``beta`` per byte here, so sparse pairs cost ``(c + isize) * beta`` and
dense words ``isize * beta``; a separate ``beta_sparse`` may be calibrated when
sparse traffic moves at another rate). ``gamma`` is the local cost per element
merged in a sparse reduction, ``gamma_dense`` per element of a dense addition
(two orders of magnitude apart on a CPU: a sorted merge against a vector add);
reduced.

The fill-in ``K`` of the reduced result is estimated with the closed form of
Appendix B.1 for uniformly distributed indices, written as a product so that
every rank may contribute a different ``k_i``:

    E[K] = N (1 - prod_i (1 - k_i / N))

which for equal ``k_i = k`` equals ``N sum_{i=1}^{P} (-1)^(i-1) C(P,i) (k/N)^i``.

Defaults describe a commodity TCP network (50 us latency, 1 GB/s); a stored
calibration (``sparcml calibrate``, or any JSON file with the same keys) at
``$SPARCML_CALIBRATION`` or ``~/.config/sparcml/calibration.json`` overrides them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from .indexcode import index_field_nbytes
from .stream import dense_threshold
from .wire import HEADER_BYTES

__all__ = ["CostModel", "calibration_path", "expected_fill_in"]


def calibration_path() -> Path:
    """Where a stored calibration is looked for."""
    return _calibration_path(os.environ.get("SPARCML_CALIBRATION"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _calibration_path(env: str | None, home: str | None) -> Path:
    # (asked on every call of ``auto``: the path is built once per environment)
    if env:
        return Path(env)
    return Path.home() / ".config" / "sparcml" / "calibration.json"


def expected_fill_in(size: int, ks: Sequence[int]) -> float:
    """Expected nnz of the sum of sets of ``ks[i]`` uniform random indices (Appendix B.1).

    Example:
        >>> round(expected_fill_in(512, [64] * 8))  # 512 (1 - (7/8)^8)
        336
    """
    if size <= 0:
        return 0.0
    log_empty = sum(math.log1p(-min(k, size) / size) if k < size else -math.inf for k in ks)
    return size * (1.0 - math.exp(log_empty))


#: the calibration files parsed so far: (class, path, content) -> model
_LOADED: dict[tuple[type, str, bytes], CostModel] = {}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """alpha (s per message), beta (s per byte), gamma (s per element reduced).

    Attributes:
        alpha: latency of one message, seconds.
        beta: transfer time per byte of dense data, seconds.
        gamma: local reduction time per element of a sparse merge, seconds.
        gamma_dense: time per element of a dense addition (default: ``gamma``).
        beta_sparse: transfer time per byte of sparse pairs (default: ``beta``).
        source: where the numbers came from (``default`` or a file path).
        alpha_intra, beta_intra: latency and time per byte between two ranks of
            one node (shared memory, NVLink, a host's loopback); ``alpha``/``beta``
            are then the costs between nodes, through the node's one NIC.
        ranks_per_node: the topology a prediction is for (:meth:`for_topology`;
            not stored in calibration files): with more than one rank per node, the
            node's ranks share its NIC (:meth:`sharing_nic`).
        elias_fano: sparse messages may carry Elias--Fano index fields where they
            are smaller (the default, as ``index_coding="auto"`` sends them);
            False for messages with the fixed fields (:meth:`inside` with
            ``elias_fano=False``: the two-level algorithms' steps inside a node).

    Two levels go beyond paper 000's single alpha-beta pair: its own production
    run used NCCL inside nodes and SparCML between them (sec. 8), costed here
    as two pairs.
    """

    alpha: float = 50e-6
    beta: float = 1e-9
    gamma: float = 1e-9
    beta_sparse: float | None = None
    source: str = "default"
    gamma_dense: float | None = None
    alpha_intra: float = 10e-6
    beta_intra: float = 2.5e-10
    ranks_per_node: int = 1
    elias_fano: bool = True

    @property
    def gamma_add(self) -> float:
        """Per-element cost of a dense addition."""
        return self.gamma if self.gamma_dense is None else self.gamma_dense

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> CostModel:
        """The stored calibration, or the defaults if there is none.

        Raises:
            ValueError: the file exists but is not a valid calibration.
        """
        p = Path(path) if path is not None else calibration_path()
        try:
            with open(p, "rb") as f:
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return cls()
        except OSError as e:
            raise ValueError(f"invalid calibration file {p}: {e}") from e
        # (parsed once per content: ``auto`` asks on every call; a file rewritten
        # within the file system's timestamp resolution is still seen)
        key = (cls, str(p), raw)
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        model = cls._parse(p, raw)
        if len(_LOADED) >= 8:
            _LOADED.clear()  # (files rewritten many times in one process: bounded)
        _LOADED[key] = model
        return model

    @classmethod
    def _parse(cls, p: Path, raw: bytes) -> CostModel:
        try:
            data = json.loads(raw)
            return cls(
                alpha=float(data["alpha"]),
                beta=float(data["beta"]),
                gamma=float(data.get("gamma", cls.gamma)),
                beta_sparse=(
                    float(data["beta_sparse"]) if data.get("beta_sparse") is not None else None
                ),
                gamma_dense=(
                    float(data["gamma_dense"]) if data.get("gamma_dense") is not None else None
                ),
                alpha_intra=float(data.get("alpha_intra", cls.alpha_intra)),
                beta_intra=float(data.get("beta_intra", cls.beta_intra)),
                source=str(p),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"invalid calibration file {p}: {e}") from e

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write this model as JSON (to :func:`calibration_path` by default)."""
        p = Path(path) if path is not None else calibration_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self)
        data.pop("source")
        data.pop("ranks_per_node")  # a property of a run, not of the machine
        data.pop("elias_fano")  # a property of a message, not of the machine
        p.write_text(json.dumps(data, indent=2) + "\n")
        return p

    # ------------------------------------------------------------------ two levels
    def for_topology(self, ranks_per_node: int) -> CostModel:
        """This model for ranks placed ``ranks_per_node`` to a node."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
        return dataclasses.replace(self, ranks_per_node=int(ranks_per_node))

    def inside(self, elias_fano: bool = True) -> CostModel:
        """The model of messages between two ranks of one node (one level, no NIC);
        ``elias_fano=False``: messages with the fixed index fields, as the two-level
        algorithms send inside a node
        (:meth:`~sparcml.collectives.codec.StreamCodec.inside_node`)."""
        return dataclasses.replace(
            self,
            alpha=self.alpha_intra,
            beta=self.beta_intra,
            beta_sparse=None,
            ranks_per_node=1,
            elias_fano=self.elias_fano and elias_fano,
        )

    def sharing_nic(self, ranks: int) -> CostModel:
        """The model between nodes when ``ranks`` ranks of a node send through its NIC at
        once: each gets ``1/ranks`` of its bandwidth (one level)."""
        return dataclasses.replace(
            self,
            beta=self.beta * ranks,
            beta_sparse=None if self.beta_sparse is None else self.beta_sparse * ranks,
            ranks_per_node=1,
        )

    # ------------------------------------------------------------------ building blocks
    @property
    def beta_pairs(self) -> float:
        """Transfer time per byte of sparse pairs."""
        return self.beta_sparse if self.beta_sparse is not None else self.beta

    def message_time(self, pairs: float, size: int, isize: int, copies: float = 1.0) -> float:
        """Time of one message carrying ``copies`` streams of ``size`` with ``pairs`` pairs each.

        A stream past ``delta`` travels dense (SparCML sec. 5.1); a sparse one's
        indices take the smaller index field (:func:`sparcml.indexcode.layout`). The algorithms'
        cost formulas (registered with each algorithm, :mod:`sparcml.collectives`)
        are written with this and ``alpha``, ``beta``, ``gamma``.
        """
        if pairs > dense_threshold(size, _dtype_of(isize)):
            nbytes, beta = size * isize, self.beta
        else:
            nbytes = index_field_nbytes(size, pairs, elias_fano=self.elias_fano) + pairs * isize
            beta = self.beta_pairs
        return self.alpha + beta * copies * (nbytes + HEADER_BYTES)


def _dtype_of(isize: int):  # type: ignore[no-untyped-def]
    import torch

    return {2: torch.float16, 4: torch.float32, 8: torch.float64}[isize]
