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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...collectives import algorithms, reduce_scatter, sparse_allreduce
from ...collectives.codec import EXACT, QUANTIZE_MODES, StreamCodec, check_index_coding
from ...collectives.registry import algorithm_info, get_algorithm, options_of
from ...comm import Communicator
from ...compress.base import check_kind, selector_and_quantizer, split_composition
from ...compress.selection import MAGNITUDE_BITS, select_above
from ...finite import all_finite
from ...stream import SparseStream, dense_threshold
from ..rules import Density
from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method

if TYPE_CHECKING:
    from ..bucket import Bucket

__all__ = [
    "NONZEROS",
    "SPARSE",
    "Nonzeros",
    "TopK",
    "allreduce_selection",
    "keeps_k",
    "nonzeros_of",
    "scatter",
    "valid_algorithms",
]


def valid_algorithms(kind: str, method: str) -> list[str]:
    """The ``algorithm=`` choices that work with a method (besides ``"auto"``)."""
    if kind not in ("sparse", "nonzeros"):
        return []
    out = []
    for name in algorithms():
        info = algorithm_info(name)
        if info.required_options or info.input == "accumulator":
            continue  # selects itself from the accumulator (k=, state=): not a stream's reducer
        if kind == "nonzeros" and not algorithm_info(name).exact:
            continue  # lossless: no algorithm that drops entries
        if split_composition(method)[1] is not None and name == "dense":
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


@dataclasses.dataclass(frozen=True)
class TopK(MethodConfig):
    """SparCML's (quantized) TopK SGD: any selector, optionally with a value quantizer.

    Example:
        >>> TopK(density=0.01, selector="trimmed_topk", quantizer="natural").name
        'trimmed_topk+natural'

    Attributes:
        density: fraction of each bucket's entries a rank selects (a number in
            (0, 1], or a schedule ``step -> density``).
        selector: the selector (:func:`sparcml.compress.available`: ``topk``,
            ``trimmed_topk``, ``randomk``, ``gaussiank``, ...).
        quantizer: a value quantizer for the selected values (``natural``,
            ``qsgd``, ...), or None.
        algorithm: the sparse allreduce algorithm (:func:`sparcml.algorithms`) or ``"auto"``.
        compressor_params: extra hyperparameters of the selector/quantizer
            (``{"bits": 4}`` for QSGD, ...).
        quantize: with a quantizer, which messages are quantized: ``"contributions"``
            (SparCML's Alg. 1: each rank's selection once, partial sums exact),
            ``"all"`` (partial sums re-quantized at every stage) or ``"dense"``.
        index_coding: how indices travel (:mod:`sparcml.collectives.codec`):
            ``"auto"`` (Elias--Fano where smaller, for CPU streams), ``"fixed"``
            (``c``-byte words), ``"elias-fano"`` (where smaller, on every device)
            or ``"delta"`` (as ``"auto"``, and quantized messages' indices as
            varints of their gaps).
    """

    NAME_FIELDS: ClassVar[tuple[str, ...]] = ("selector", "quantizer")

    density: Density = 0.01
    selector: str = "topk"
    quantizer: str | None = None
    algorithm: str = "auto"
    compressor_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantize: str = "contributions"
    index_coding: str = "auto"

    @property
    def name(self) -> str:
        return self.selector if self.quantizer is None else f"{self.selector}+{self.quantizer}"

    @classmethod
    def from_name(cls, name: str, options: Mapping[str, Any]) -> TopK:
        selector, quantizer = split_composition(name)
        return cls(selector=selector, quantizer=quantizer, **options)

    def validate(self) -> None:
        check_kind(self.selector, "selector")
        if self.quantizer is not None:
            check_kind(self.quantizer, "quantizer")
        check_algorithm("sparse", self.name, self.algorithm)
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"quantize must be one of {', '.join(map(repr, QUANTIZE_MODES))}, "
                f"got {self.quantize!r}"
            )
        check_index_coding(self.index_coding)
        object.__setattr__(self, "compressor_params", dict(self.compressor_params or {}))


def run_sparse(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    selector, _ = selector_and_quantizer(group.operator(bucket.key))
    t0 = time.perf_counter()
    # nan_policy="propagate": NaN/Inf in the accumulator are flagged in the
    # collective's own header (checks_nonfinite), not agreed in a round of their
    # own; a flagged rank selects nothing, and every rank raises NonFiniteError, on
    # which the bucket goes dense for this step. A selector with state never sees
    # them; a stateless one selects first: NaN/Inf are non-zeros, so a selection
    # holding every non-zero holds them all, and the check reads it (O(k)) instead
    # of the bucket; a top-k's one-pass search on the CPU kept every NaN/Inf among
    # its candidates and tells (select_checked), so nothing is read again
    propagate = group.settings.nan_policy == "propagate"
    nonfinite = propagate and not selector.stateless and not all_finite(acc)
    selected: SparseStream | None = None
    covering = False
    if not nonfinite:
        selected, covering, finite = selector.select_checked(acc)
        if propagate and selector.stateless:
            # (finite: the selection saw every entry that could be NaN or +-inf)
            if finite is None:
                finite = all_finite(selected.values if covering else acc)
            nonfinite = not finite
    if nonfinite or selected is None:
        selected, covering = SparseStream.empty(acc.numel(), acc.dtype, acc.device), False
    select_s = time.perf_counter() - t0
    total = allreduce_selection(group, bucket, selected, nonfinite)
    # (the pipeline averages the stream)
    return MethodResult(selected, total, select_s, covering)


def keeps_k(algorithm: str) -> bool:
    """Whether the sparse allreduce ``algorithm`` keeps ``k`` entries of the sum
    (``gtopk``'s tree) rather than summing exactly."""
    return algorithm != "auto" and "k" in options_of(get_algorithm(algorithm))


def allreduce_selection(
    group: GroupView, bucket: Bucket, selected: SparseStream, nonfinite: bool
) -> SparseStream:
    """Step 5's collective of the ``sparse`` method: this rank's selection through
    the configured sparse allreduce (quantized by the method's quantizer), with the
    accumulator's NaN/Inf flag in its header. Every rank calls it with the same
    arguments but its own selection, also one that skipped the selector (a sparse
    gradient sent as it is: :func:`sparcml.torch.reduce.reduce_sparse_gradient`).

    Raises:
        NonFiniteError: a rank flagged NaN/Inf (on every rank).
    """
    selector, quantizer = selector_and_quantizer(group.operator(bucket.key))
    cfg = group.config
    assert isinstance(cfg, TopK)
    # an algorithm that keeps k entries (gtopk) is told the selector's k: a selection
    # leaves the zeros out of a tensor with fewer non-zeros than k
    spec = getattr(selector, "spec", None)
    takes_k = keeps_k(cfg.algorithm)
    extra = {"k": spec.of(selected.size)} if takes_k and spec is not None else {}
    return sparse_allreduce(
        selected,
        group.comm,
        algorithm=cfg.algorithm,
        quantizer=quantizer,
        quantize=cfg.quantize if quantizer is not None else "dense",
        index_coding=cfg.index_coding,
        call_id=bucket.step,
        nonfinite=nonfinite,
        **extra,
    )


def scatter_sparse(
    group: GroupView, bucket: Bucket, acc: torch.Tensor, bounds: list[int]
) -> MethodResult:
    """FSDP2's reduce-scatter: ``TopK(acc)`` split by owner (quantized once with a
    quantizer), rank ``j`` summing chunk ``j`` (paper 000 sec. 5.3.2's split phase)."""
    selector, quantizer = selector_and_quantizer(group.operator(bucket.key))
    t0 = time.perf_counter()
    selected, covering = selector.select_covering(acc)
    select_s = time.perf_counter() - t0
    codec = EXACT
    if quantizer is not None:
        cfg = group.config
        assert isinstance(cfg, TopK)
        codec = StreamCodec(quantizer, "contributions", index_coding=cfg.index_coding)
    total = scatter(selected, group.comm, codec, bounds)
    return MethodResult(selected, total, select_s, covering)


def scatter(
    stream: SparseStream, comm: Communicator, codec: StreamCodec, bounds: list[int]
) -> torch.Tensor:
    """This rank's chunk of the sum of ``stream`` over ranks: the split phase alone, or
    in two levels on ranks that span nodes (:func:`~sparcml.collectives.reduce_scatter`)."""
    if codec is not EXACT:
        codec = codec.with_call(comm.next_sequence(), comm.rank)
    return reduce_scatter(stream, comm, codec, bounds).to_dense()


SPARSE = register_method(
    MethodSpec(
        "sparse",
        "a selector (maybe + quantizer) with error feedback through the sparse allreduce",
        run_sparse,
        config=TopK,
        operator=True,
        checks_nonfinite=True,
        sparse_gradients=True,
        scatter=scatter_sparse,
    )
)


@dataclasses.dataclass(frozen=True)
class Nonzeros(MethodConfig):
    """Lossless: the gradient's own non-zeros through the sparse allreduce.

    Attributes:
        algorithm: the (exact) sparse allreduce algorithm, or ``"auto"``.
    """

    algorithm: str = "auto"

    def validate(self) -> None:
        check_algorithm("nonzeros", "nonzeros", self.algorithm)


def nonzeros_of(acc: torch.Tensor) -> SparseStream:
    """``SparseStream.from_dense(acc)`` of a flat ``acc`` the caller gives up: on the
    CPU the non-zeros (NaN included, ``-0.0`` not, as ``count_nonzero`` counts them)
    in one compiled scan, where ``from_dense`` counts them, then finds them with
    ``torch.nonzero`` (two passes, the second slow: ``benchmarks/engine_profile.py
    --method nonzeros``); past SparCML's ``delta`` the stream is dense."""
    if acc.device.type != "cpu" or acc.dtype not in MAGNITUDE_BITS:
        return SparseStream.from_dense(acc)
    idx = select_above(acc, 0.0)
    if idx.numel() > dense_threshold(acc.numel(), acc.dtype):
        return SparseStream.dense(acc)
    return SparseStream.from_sorted(idx, acc[idx], acc.numel())


def run_nonzeros(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    cfg = group.config
    assert isinstance(cfg, Nonzeros)
    total = sparse_allreduce(
        nonzeros_of(acc), group.comm, algorithm=cfg.algorithm, call_id=bucket.step
    )
    return MethodResult(None, total)  # (the pipeline averages the stream on its entries)


def scatter_nonzeros(
    group: GroupView, bucket: Bucket, acc: torch.Tensor, bounds: list[int]
) -> MethodResult:
    """Each chunk's non-zeros as a sparse message, summed by its owner (exact)."""
    return MethodResult(None, scatter(SparseStream.from_dense(acc), group.comm, EXACT, bounds))


NONZEROS = register_method(
    MethodSpec(
        "nonzeros",
        "lossless sparse allreduce of the gradient's non-zeros (SparCML on naturally "
        "sparse gradients, e.g. linear models on hashed features)",
        run_nonzeros,
        config=Nonzeros,
        names=("nonzeros",),
        unbiased=True,
        lossless=True,
        sparse_gradients=True,
        scatter=scatter_nonzeros,
    )
)
