"""Selector methods (``topk``, ``randomk``, ... and ``selector+quantizer``) and ``nonzeros``.

* ``sparse``: SparCML's (quantized) TopK SGD, Alg. 1 step 3: ``g = allreduce(Q(TopK(acc)))``
  through :func:`~sparcml.sparse_allreduce` (any algorithm, ``auto`` by default);
  with a quantizer each rank's selection is quantized once and summed exactly
  (``quantize="contributions"``, the default; see :mod:`sparcml.collectives.codec`).
* ``nonzeros``: lossless: the gradient's own non-zeros through the sparse allreduce
  (paper 000 sec. 8.2, Table 2: linear models, whose gradients are sparse without
  any selection).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from ...collectives import algorithms, sparse_allreduce
from ...collectives.codec import QUANTIZE_MODES
from ...collectives.registry import algorithm_info
from ...compress.base import Composed, Selector, all_finite
from ...stream import SparseStream
from .base import MethodConfig, MethodSpec, register_method

if TYPE_CHECKING:
    from ..reduce import Bucket
    from ..state import SparcmlState

__all__ = ["NONZEROS", "SPARSE", "NonzerosConfig", "SparseConfig", "valid_algorithms"]


def valid_algorithms(kind: str, method: str) -> list[str]:
    """The ``algorithm=`` choices that work with a method (besides ``"auto"``)."""
    if kind not in ("sparse", "nonzeros"):
        return []
    out = []
    for name in algorithms():
        if algorithm_info(name).options:
            continue  # needs per-call options (k=, state=): not a selected stream's reducer
        if kind == "nonzeros" and not algorithm_info(name).exact:
            continue  # lossless: no algorithm that drops entries
        if "+" in method and name == "dense":
            continue  # cannot quantize
        out.append(name)
    return out


def check_algorithm(kind: str, method: str, algorithm: str) -> None:
    """Raise ``ValueError`` if ``algorithm`` cannot run ``method``, listing the choices."""
    if algorithm == "auto":
        return
    valid = valid_algorithms(kind, method)
    if algorithm not in valid:
        hint = ""
        if algorithm == "oktopk":
            hint = " (Ok-Topk is a method of its own: SparcmlState('oktopk'))"
        elif algorithm not in algorithms():
            hint = " (unknown sparse allreduce algorithm)"
        raise ValueError(
            f"algorithm {algorithm!r} cannot run method {method!r}{hint}; "
            f"valid choices: auto, {', '.join(valid)}"
        )


@dataclasses.dataclass
class SparseConfig(MethodConfig):
    """Hyperparameters of the selector methods.

    Attributes:
        algorithm: the sparse allreduce algorithm (:func:`sparcml.algorithms`) or ``"auto"``.
        compressor_params: extra hyperparameters of the selector/quantizer
            (``{"bits": 4}`` for QSGD, ...).
        quantize: with a quantizer, which messages are quantized: ``"contributions"``
            (SparCML's Alg. 1: each rank's selection once, partial sums exact),
            ``"all"`` (partial sums re-quantized at every stage) or ``"dense"``.
        index_coding: ``"delta"``: indices of quantized sparse messages as varints of
            their gaps; ``"fixed"``: ``c``-byte words.
    """

    algorithm: str = "auto"
    compressor_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantize: str = "contributions"
    index_coding: str = "fixed"

    def validate(self, method: str) -> None:
        check_algorithm("sparse", method, self.algorithm)
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"quantize must be one of {', '.join(map(repr, QUANTIZE_MODES))}, "
                f"got {self.quantize!r}"
            )
        if self.index_coding not in ("fixed", "delta"):
            raise ValueError(f"index_coding must be 'fixed' or 'delta', got {self.index_coding!r}")
        self.compressor_params = dict(self.compressor_params or {})


def run_sparse(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    op = state.operator(bucket.key)
    selector: Selector = op.selector if isinstance(op, Composed) else op
    quantizer = op.quantizer if isinstance(op, Composed) else None
    t0 = time.perf_counter()
    # nan_policy="propagate": NaN/Inf in the accumulator are flagged in the
    # collective's own header (checks_nonfinite), not agreed in a round of their
    # own; a flagged rank selects nothing (its selector never sees them), and every
    # rank raises NonFiniteError, on which the bucket goes dense for this step
    nonfinite = state.nan_policy == "propagate" and not all_finite(acc)
    if nonfinite:
        selected = SparseStream.empty(acc.numel(), acc.dtype, acc.device)
    else:
        selected = selector.select(acc)
    state.select_s += time.perf_counter() - t0  # (statistics: compress vs communicate)
    cfg = state.config
    total = sparse_allreduce(
        selected,
        state.comm,
        algorithm=cfg.algorithm,
        quantizer=quantizer,
        quantize=cfg.quantize if quantizer is not None else "dense",
        index_coding=cfg.index_coding,
        call_id=bucket.step,
        nonfinite=nonfinite,
    )
    return selected, total.to_dense()


SPARSE = register_method(
    MethodSpec(
        "sparse",
        "a selector (maybe + quantizer) with error feedback through the sparse allreduce",
        run_sparse,
        config=SparseConfig,
        operator=True,
        checks_nonfinite=True,
    )
)


@dataclasses.dataclass
class NonzerosConfig(MethodConfig):
    """Attributes:
    algorithm: the (exact) sparse allreduce algorithm, or ``"auto"``.
    """

    algorithm: str = "auto"

    def validate(self, method: str) -> None:
        check_algorithm("nonzeros", method, self.algorithm)


def run_nonzeros(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    total = sparse_allreduce(
        SparseStream.from_dense(acc),
        state.comm,
        algorithm=state.config.algorithm,
        call_id=bucket.step,
    )
    return None, total.to_dense()


NONZEROS = register_method(
    MethodSpec(
        "nonzeros",
        "lossless sparse allreduce of the gradient's non-zeros (SparCML on naturally "
        "sparse gradients, e.g. linear models on hashed features)",
        run_nonzeros,
        config=NonzerosConfig,
        names=("nonzeros",),
        unbiased=True,
        lossless=True,
    )
)
