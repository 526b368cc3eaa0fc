"""RedSync's residual gradient compression synchronisation (paper 002, sec. 3.2-3.4).

Per bucket, on every rank (the residual accumulation and update are the shared
pipeline's steps 4 and 6, :mod:`sparcml.torch.reduce`):

1. Hybrid selection per layer (sec. 3.2): layers smaller than ``min_bytes``
   (RedSync: 128 KB; biases, norms) are not compressed and go whole; middle-size
   layers use trimmed top-k (Alg. 2, exactly ``k`` entries); layers of at least
   ``bsearch_numel`` entries use threshold binary search (Alg. 3, between
   ``k`` and ``2k`` entries), sampled (threshold reused for 5 calls) unless ASQ is
   on, since "sampled threshold binary search cannot be used with quantization".
2. Optional ASQ (sec. 2.2): instead, every compressed layer but the output layer
   ("we also do not quantify the output layer") sends its top entries of one
   sign, alternating per call, as indices plus one mean value (no signs), chosen
   by trimmed top-k or (large layers) the non-sampled threshold binary search.
   The sent entries' residual restarts at zero (Alg. 1: "remaining elements
   outside the communication-set are assigned as new residuals"); with
   ``asq_feedback="quantization_error"`` it keeps ``x - mean`` instead.
3. Pack (sec. 3.4): this rank's whole bucket becomes one message — the exact
   wire encoding of the uncompressed layers and the non-ASQ selections, plus one
   ASQ payload per layer — "instead of two Allgather operations for indices and
   values ... we package them into a single message to reduce latency".
4. Allgather of the packed messages (recursive doubling, unknown sizes), then
   every rank decodes the ``P`` messages and adds them in rank order, so the
   result has the same bits everywhere: steps 3-4 are the collective
   :func:`~sparcml.collectives.packed_allgather.packed_allgather`.

Cost (sec. 3.4's model, ``D`` the density averaged over ranks, ``M`` bucket
entries, ``isize + c`` bytes per pair): ``T = log2(P) alpha +
(P-1) M D (isize + c) beta + P M D gamma`` (decompression of ``P`` messages);
with ASQ ``(P-1) M D c beta``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from ...collectives.packed_allgather import packed_allgather
from ...compress import get
from ...compress.asq import ASQ
from ...compress.base import Context
from ...stream import SparseStream
from ..rules import Density
from .base import GroupView, MethodConfig, MethodResult, MethodSpec, register_method

if TYPE_CHECKING:
    from ..bucket import Bucket

log = logging.getLogger("sparcml")
_WARNED: list[bool] = []  # (output_layer="auto" unknown: said once)

__all__ = ["REDSYNC", "RedSync", "redsync_allgather", "redsync_selector"]


@dataclasses.dataclass(frozen=True)
class RedSync(MethodConfig):
    """RedSync's residual gradient compression (paper 002).

    Example:
        >>> RedSync(density=0.01, asq=True).min_bytes
        131072

    Attributes:
        density: fraction of each layer's entries selected (or a schedule).
        asq: alternating-sign quantization on top of the selection.
        asq_feedback: what an ASQ-sent entry leaves in the residual:
            ``"paper"`` (Alg. 1: the sent entries restart at zero) or
            ``"quantization_error"`` (``x - mean``; beyond the paper).
        output_layer: the layer left unquantized under ASQ: ``"auto"`` (the
            module of the last registered parameter), a name prefix, or None.
        min_bytes: layers smaller than this go uncompressed (RedSync: 128 KB).
        bsearch_numel: layers with at least this many entries use threshold
            binary search (sampled, unless quantized), smaller ones trimmed top-k.
    """

    density: Density = 0.01
    asq: bool = False
    asq_feedback: str = "paper"
    output_layer: str | None = "auto"
    min_bytes: int = 128 * 1024
    bsearch_numel: int = 1 << 20

    def validate(self) -> None:
        if self.asq_feedback not in ("paper", "quantization_error"):
            raise ValueError(
                f"asq_feedback must be 'paper' or 'quantization_error', got {self.asq_feedback!r}"
            )
        if self.min_bytes < 0 or self.bsearch_numel < 1:
            raise ValueError("min_bytes must be >= 0 and bsearch_numel >= 1")


def is_output_layer(group: GroupView, name: str) -> bool:
    """Whether ``name`` belongs to the layer RedSync leaves unquantized."""
    prefix = group.config.output_layer
    if prefix == "auto":
        if getattr(group.param_names, "in_bucket_order", False):
            # named by the hook as buckets came (reverse registration order): the
            # output layer is not known; none is exempted (register() knows it, or
            # pass output_layer="paramN")
            if not _WARNED:
                _WARNED.append(True)
                log.warning(
                    "redsync: output_layer='auto' needs the model's parameter names "
                    "(sparcml.torch.register); under a hand-registered hook or "
                    "comm_hook() no layer is left unquantized"
                )
            return False
        names = list(group.param_names.values())  # in registration order
        if not names:
            return False
        last = names[-1]
        prefix = last.rpartition(".")[0] or last  # its module, or the parameter itself
    if not prefix:
        return False
    return name == prefix or name.startswith(prefix + ".")


def redsync_selector(group: GroupView, name: str, numel: int, element_size: int) -> Any:
    """Step 1's per-layer choice: None (uncompressed), ASQ, trimmed top-k or binary search.

    Selectors keep state across calls (ASQ's sign, the sampled threshold), so one
    instance is kept per parameter name.
    """
    if numel * element_size < group.config.min_bytes:
        return None

    def build() -> Any:
        large = numel >= group.config.bsearch_numel
        if group.config.asq and not is_output_layer(group, name):
            selector = "threshold_bsearch" if large else "trimmed_topk"
            return ASQ(density=group.density, selector=selector)
        if large:
            return get("sampled_threshold_bsearch", density=group.density)
        return get("trimmed_topk", density=group.density)

    return group.cached_operator(("redsync", name), build)


def redsync_allgather(group: GroupView, bucket: Bucket, acc: torch.Tensor) -> MethodResult:
    """Steps 1-4 for one bucket; returns (this rank's sent part, the sum over ranks)."""
    comm = group.comm
    n = acc.numel()
    offsets = [0]
    for size in bucket.sizes:
        offsets.append(offsets[-1] + size)
    plain_idx: list[torch.Tensor] = []
    asq_parts: list[tuple[int, torch.Tensor]] = []
    sent_idx: list[torch.Tensor] = []
    sent_val: list[torch.Tensor] = []
    # Step 1 (and 2): per-layer selection.
    for j, (name, lo, hi) in enumerate(zip(bucket.names, offsets[:-1], offsets[1:], strict=True)):
        layer = acc[lo:hi]
        op = redsync_selector(group, name, hi - lo, acc.element_size())
        if op is None:
            idx = torch.arange(lo, hi, device=acc.device)
            plain_idx.append(idx)
            sent_idx.append(idx)
            sent_val.append(layer)
        elif isinstance(op, ASQ):
            payload, _ = op.compress(layer)
            asq_parts.append((j + 1, payload))
            mine = op.decompress(payload, Context.of(layer))
            nz = torch.nonzero(mine).reshape(-1)
            sent_idx.append(nz + lo)
            # what the residual update subtracts: the entries themselves (paper), or
            # the mean that travelled (the quantization error stays in the residual)
            paper = group.config.asq_feedback == "paper"
            sent_val.append(layer[nz] if paper else mine[nz])
        else:
            s = op.select(layer)
            if s.is_dense:
                s = SparseStream.from_sorted(
                    torch.arange(s.size, device=acc.device), s.to_dense(), s.size
                )
            plain_idx.append(s.indices + lo)
            sent_idx.append(s.indices + lo)
            sent_val.append(s.values)
    if sent_idx:
        all_idx, all_val = torch.cat(sent_idx), torch.cat(sent_val)
    else:
        all_idx = torch.zeros(0, dtype=torch.int64, device=acc.device)
        all_val = acc.new_zeros(0)
    # Step 3: one message per rank.
    if plain_idx:
        idx = torch.cat(plain_idx)
        plain = SparseStream.from_sorted(idx, acc[idx], n)
    else:
        plain = SparseStream.empty(n, acc.dtype, acc.device)
    # Steps 3-4: one packed message per rank, allgathered and summed in rank order
    total = packed_allgather(plain, asq_parts, offsets, comm)
    return MethodResult(SparseStream.from_sorted(all_idx, all_val, n), total)


REDSYNC = register_method(
    MethodSpec(
        "redsync",
        "RedSync RGC: per-layer trimmed top-k / threshold binary search, optional ASQ, "
        "one packed allgather message per rank (paper 002)",
        redsync_allgather,
        config=RedSync,
        names=("redsync",),
    )
)
