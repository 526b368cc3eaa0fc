"""One bucket's gradient synchronisation: the pipeline every method shares.

A bucket is a flat gradient made of consecutive parameters (a DDP ``GradBucket``,
or a group of parameters in :func:`~sparcml.torch.sync_gradients`). Per bucket and
step, on every rank (the steps of SparCML's Alg. 1 and RedSync's Alg. 1, with
DGC's additions as RedSync sec. 3.5 describes them):

1. warm-up: during the first ``warmup_steps`` steps, a dense allreduce, nothing else
   (with momentum correction: of the momentum ``u = m u + g``, i.e. momentum SGD);
2. NaN policy: with ``nan_policy="raise"``, every rank learns which ranks and
   parameters hold NaN/Inf, and all raise the same error; with ``"propagate"``
   (compressed methods), a bucket holding NaN/Inf on any rank is reduced densely
   for that step, so every method returns what dense allreduce would (NaN/Inf
   where any rank had them), on every rank, and keeps its residuals and momenta
   unchanged (one tiny allreduce per bucket agrees on it);
3. local gradient clipping to ``clip_norm / sqrt(P)``, of this bucket's
   gradient (``clip_scope="bucket"``; :func:`~sparcml.torch.sync_gradients` with
   ``clip_scope="model"`` clips the whole local gradient first, as RedSync does);
4. accumulation: ``acc = residual + g`` (error feedback), or DGC momentum
   correction ``u = m u + g; v = v + u; acc = v``;
5. the method's collective, returning this rank's sent part and the sum;
6. residual update ``residual = acc - sent`` (and momentum factor masking:
   ``u = 0`` where ``v`` was sent);
7. the average ``sum / P``, bitwise identical on every rank.

Residuals and momenta are kept per parameter name, so they survive DDP bucket
rebuilds (the bucket's view is assembled from them each step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from ..collectives import oktopk_allreduce, sparse_allreduce
from ..compress.base import Composed, Quantizer, Selector
from ..stream import SparseStream
from .redsync import redsync_allgather
from .state import SparcmlState

__all__ = ["Bucket", "reduce_bucket"]

log = logging.getLogger("sparcml")


@dataclasses.dataclass
class Bucket:
    """One bucket of one step: parameter names and sizes, and this rank's gradient."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    grad: torch.Tensor  # flat
    step: int

    @property
    def key(self) -> tuple[str, ...]:
        return self.names


# Each method returns (what this rank sent, as a dense tensor or stream, or None when
# nothing is fed back; the sum over ranks as a flat dense tensor).
Method = Callable[
    [SparcmlState, Bucket, torch.Tensor], tuple[torch.Tensor | SparseStream | None, torch.Tensor]
]


def _dense(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    return acc, state.comm.allreduce(acc)


def _sparse(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """SparCML's (quantized) TopK SGD, Alg. 1 step 3: allreduce of Q(TopK(acc))."""
    op = state.operator(bucket.key)
    selector: Selector = op.selector if isinstance(op, Composed) else op
    quantizer = op.quantizer if isinstance(op, Composed) else None
    selected = selector.select(acc)
    total = sparse_allreduce(
        selected,
        state.comm,
        algorithm=state.algorithm,
        quantizer=quantizer,
        quantize=state.quantize if quantizer is not None else "dense",
        index_coding=state.index_coding,
        call_id=bucket.step,
    )
    return selected, total.to_dense()


def _quantized(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """Dense quantized allreduce: DSAR's split allgather with every message's values
    quantized (paper 000 sec. 6; paper 004's C_nat / dithering as ``Q``)."""
    op = state.operator(bucket.key)
    assert isinstance(op, Quantizer)
    total = sparse_allreduce(
        SparseStream.from_dense(acc),
        state.comm,
        algorithm="dsar_split_allgather",
        quantizer=op,
        quantize="all",
        call_id=bucket.step,
    )
    # Unbiased quantizers feed nothing back (the state refuses error feedback here).
    return None, total.to_dense()


def _nonzeros(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """Lossless: the gradient's own non-zeros through the sparse allreduce (paper 000
    sec. 8.2, Table 2: linear models, whose gradients are sparse without any selection)."""
    total = sparse_allreduce(
        SparseStream.from_dense(acc), state.comm, algorithm=state.algorithm, call_id=bucket.step
    )
    return None, total.to_dense()


def _oktopk(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """Ok-Topk SGD (paper 001), lines 5-6: ``u, indexes = Ok_sparse_allreduce(acc)``."""
    k = min(acc.numel(), max(1, round(state.density * acc.numel())))  # as the selectors count
    result = oktopk_allreduce(acc, k, state.comm, state.oktopk_state(bucket.key))
    idx = result.local_indices
    sent = SparseStream.from_sorted(idx, acc[idx], acc.numel())
    return sent, result.stream.to_dense()


def _natural_ina(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """Paper 004 Alg. 1 with INA: workers send C_nat(g_i) as integers, the aggregator
    sums them and returns C_nat(sum) (master-side compression). The first call agrees
    on the session (a random token, and a MAC key with ``ina_secret``) through the
    process group: a collective, in the same order on every rank like every bucket."""
    from ..ina import InaStats, agree_session, ina_allreduce

    assert state.ina_address is not None
    comm = state.comm
    if state.ina_session is None:
        state.ina_session = agree_session(comm, state.ina_mode, state.ina_secret)
    stats = InaStats()
    call = state.ina_calls
    state.ina_calls += 1
    total = ina_allreduce(
        acc, state.ina_address, state.ina_session, comm.rank, comm.world_size, state.ina_mode,
        job=state.ina_job, seed=state.seed, call=call, timeout=comm.timeout, stats=stats,
    )  # fmt: skip
    comm.stats.bytes_sent += stats.bytes_sent  # counted like every method's traffic
    return None, total


def _redsync(state: SparcmlState, bucket: Bucket, acc: torch.Tensor):  # type: ignore[no-untyped-def]
    return redsync_allgather(state, bucket, acc)


METHODS: dict[str, Method] = {
    "dense": _dense,
    "sparse": _sparse,
    "quantized": _quantized,
    "nonzeros": _nonzeros,
    "oktopk": _oktopk,
    "redsync": _redsync,
    "natural_ina": _natural_ina,
}


def _gather(store: dict[str, torch.Tensor], bucket: Bucket, like: torch.Tensor) -> torch.Tensor:
    """The bucket's flat view of per-parameter buffers (zeros where none exists yet)."""
    parts = []
    for name, n in zip(bucket.names, bucket.sizes, strict=True):
        t = store.get(name)
        if t is None or t.numel() != n or t.dtype != like.dtype or t.device != like.device:
            t = torch.zeros(n, dtype=like.dtype, device=like.device)
        parts.append(t)
    return torch.cat(parts) if parts else like.new_zeros(0)


def _scatter(store: dict[str, torch.Tensor], bucket: Bucket, flat: torch.Tensor) -> None:
    for name, part in zip(bucket.names, flat.split(list(bucket.sizes)), strict=True):
        store[name] = part


def _sent_and_mask(
    sent: torch.Tensor | SparseStream, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank sent, dense, and where it sent something."""
    if isinstance(sent, SparseStream):
        if sent.is_dense:
            dense = sent.to_dense()
            return dense, dense != 0
        out = torch.zeros_like(like)
        out[sent.indices] = sent.values
        mask = torch.zeros_like(like, dtype=torch.bool)
        mask[sent.indices] = True
        return out, mask
    return sent, torch.ones_like(like, dtype=torch.bool)


def _check_finite(state: SparcmlState, bucket: Bucket, g: torch.Tensor) -> None:
    comm = state.comm
    bad = [
        i
        for i, part in enumerate(g.split(list(bucket.sizes)))
        if part.numel() and not bool(torch.isfinite(part).all())
    ]
    flags = torch.zeros(comm.world_size, dtype=torch.int64)
    flags[comm.rank] = 1 if bad else 0
    flags = comm.allreduce(flags)
    if int(flags.sum()):
        ranks = [r for r in range(comm.world_size) if int(flags[r])]
        mine = ", ".join(bucket.names[i] for i in bad) or "none"
        raise FloatingPointError(
            f"NaN/Inf gradient at step {bucket.step} on rank(s) {ranks} (nan_policy='raise'); "
            f"rank {comm.rank}'s non-finite parameters: {mine}"
        )


def _any_nonfinite(state: SparcmlState, g: torch.Tensor) -> bool:
    """Whether any rank's bucket holds NaN/Inf (a collective: every rank gets the answer)."""
    bad = torch.tensor([0 if bool(torch.isfinite(g).all()) else 1], dtype=torch.int64)
    return bool(int(state.comm.allreduce(bad)))


def reduce_bucket(state: SparcmlState, bucket: Bucket) -> torch.Tensor:
    """Steps 1-7 above for one bucket; returns the averaged flat gradient."""
    comm = state.comm
    p = comm.world_size
    g = bucket.grad.detach().reshape(-1)
    before = comm.stats.bytes_sent
    try:
        # Step 1: dense warm-up.
        if bucket.step < state.warmup_steps or state.kind == "dense":
            if state.nan_policy == "raise":
                _check_finite(state, bucket, g)
            if state.momentum and state.kind != "dense":
                # with momentum correction the optimizer has no momentum: warm-up
                # steps are dense momentum SGD, u = m u + g, averaged (no masking)
                u = _gather(state.momenta, bucket, g)
                u.mul_(state.momentum).add_(g)
                _scatter(state.momenta, bucket, u)
                return comm.allreduce(u) / p
            return comm.allreduce(g) / p
        # Step 2: NaN policy.
        if state.nan_policy == "raise":
            _check_finite(state, bucket, g)
        elif state.kind != "nonzeros" and _any_nonfinite(state, g):
            # propagate: compressed methods cannot place NaN/Inf where dense would
            # (selectors may drop them into the residual, quantizers cannot encode
            # them): this bucket goes dense for this step, residuals untouched
            log.warning(
                "NaN/Inf gradient at step %d (bucket %s): reduced densely, the average "
                "is non-finite (nan_policy='propagate')",
                bucket.step,
                bucket.names[0] if bucket.names else "?",
            )
            return comm.allreduce(g) / p
        # Step 3: local gradient clipping (DGC: threshold scaled by P^-1/2).
        if state.clip_norm is not None and state.clip_scope == "bucket":
            limit = state.clip_norm / math.sqrt(p)
            norm = float(torch.linalg.vector_norm(g.double())) if g.numel() else 0.0
            if norm > limit:
                g = g * (limit / (norm + 1e-12))
        # Step 4: accumulation.
        if state.momentum:
            u = _gather(state.momenta, bucket, g)
            u.mul_(state.momentum).add_(g)
            acc = _gather(state.residuals, bucket, g) + u
        elif state.error_feedback:
            acc = _gather(state.residuals, bucket, g) + g
        else:
            acc = g.clone()
        # Step 5: the method's collective.
        sent, total = METHODS[state.kind](state, bucket, acc)
        # Step 6: residuals (and momentum factor masking).
        if state.momentum or state.error_feedback:
            assert sent is not None
            sent_dense, mask = _sent_and_mask(sent, acc)
            _scatter(state.residuals, bucket, acc - sent_dense)
            if state.momentum:
                if state.momentum_masking:
                    u = u.masked_fill(mask, 0.0)
                _scatter(state.momenta, bucket, u)
        # Step 7: the average.
        return (total / p).to(g.dtype)
    finally:
        sent_bytes = comm.stats.bytes_sent - before
        state.bytes_sent += sent_bytes
        while len(state.step_bytes) <= bucket.step:
            state.step_bytes.append(0)
        state.step_bytes[bucket.step] += sent_bytes
