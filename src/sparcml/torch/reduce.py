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

import torch

from ..stream import SparseStream
from .methods import method_spec
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
                u = state.momentum_correction.accumulate(bucket.names, bucket.sizes, g)
                state.momentum_correction.keep(bucket.names, bucket.sizes, u)
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
        names, sizes = bucket.names, bucket.sizes
        if state.momentum:
            u = state.momentum_correction.accumulate(names, sizes, g)
            acc = state.feedback.compensate_bucket(names, sizes, u)
        elif state.error_feedback:
            acc = state.feedback.compensate_bucket(names, sizes, g)
        else:
            acc = g.clone()
        # Step 5: the method's collective (sparcml.torch.methods).
        sent, total = method_spec(state.kind).run(state, bucket, acc)
        # Step 6: residuals (and momentum factor masking).
        if state.momentum or state.error_feedback:
            assert sent is not None
            sent_dense, mask = _sent_and_mask(sent, acc)
            state.feedback.update_bucket(names, sizes, acc, sent_dense)
            if state.momentum:
                state.momentum_correction.keep(names, sizes, u, mask)
        # Step 7: the average.
        return (total / p).to(g.dtype)
    finally:
        sent_bytes = comm.stats.bytes_sent - before
        state.bytes_sent += sent_bytes
        while len(state.step_bytes) <= bucket.step:
            state.step_bytes.append(0)
        state.step_bytes[bucket.step] += sent_bytes
