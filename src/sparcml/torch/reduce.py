"""One bucket's gradient synchronisation: the pipeline every method shares.

A bucket is a flat gradient made of consecutive parameters (a DDP ``GradBucket``,
or a group of parameters in :func:`~sparcml.torch.sync_gradients`). Per bucket and
step, on every rank (the steps of SparCML's Alg. 1 and RedSync's Alg. 1, with
DGC's additions as RedSync sec. 3.5 describes them):

0. layer rules: the bucket's parameters are grouped by the state (method) that
   reduces them (:mod:`sparcml.torch.rules`); each group runs steps 1-7;
1. warm-up: during the first ``warmup_steps`` steps, a dense allreduce, nothing else
   (with momentum correction: of the momentum ``u = m u + g``, i.e. momentum SGD);
2. NaN policy: with ``nan_policy="raise"``, every rank learns which ranks and
   parameters hold NaN/Inf, and all raise the same error; with ``"propagate"``
   (compressed methods), a bucket holding NaN/Inf on any rank is reduced densely
   for that step, so every method returns what dense allreduce would (NaN/Inf
   where any rank had them), on every rank, and keeps its residuals and momenta
   unchanged (one tiny allreduce per bucket agrees on it; methods whose
   collective refuses NaN/Inf in its own header exchange, ``checks_nonfinite``
   in their registration, need no extra round: the refusal sends the bucket
   dense);
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

Every entry point is an adapter that cuts the gradient into buckets and hands them
here: the DDP hook (:mod:`sparcml.torch.hook`), :func:`~sparcml.torch.sync_gradients`
and ``DistributedOptimizer`` (:mod:`sparcml.torch.sync`), FSDP2's reduce-scatter
(:mod:`sparcml.torch.fsdp`: step 5 is the method's ``scatter``, step 7 is FSDP's)
and the one-tensor steps :func:`~sparcml.torch.topk_sgd_step` /
:func:`~sparcml.torch.oktopk_sgd_step` (:mod:`sparcml.torch.steps`). What differs
between methods is a fact in their registration (:mod:`sparcml.torch.methods`).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..collectives import sparse_allreduce
from ..comm import Communicator
from ..compress.base import Selector, selector_and_quantizer
from ..compress.selection import count_above, k_of, select_above
from ..compress.threshold_reuse import BRACKET_MIN
from ..compress.topk import TopK
from ..errors import NonFiniteError
from ..finite import all_finite
from ..merge import merge_sum
from ..nonzero import drop_zeros
from ..stream import SparseStream, dense_threshold
from .bucket import Bucket
from .methods.dense import scatter_dense
from .methods.sparse import allreduce_selection, keeps_k, run_sparse
from .runtime import Group
from .state import SparcmlState

__all__ = [
    "Bucket",
    "check_sparse_gradient_method",
    "count_bytes",
    "reduce_bucket",
    "reduce_group",
    "reduce_sparse_gradient",
]

log = logging.getLogger("sparcml")


def _shares_memory(a: torch.Tensor, b: torch.Tensor | SparseStream) -> bool:
    """Whether ``b`` (or a stream's values) may be a view of ``a``'s memory."""
    t = b.values if isinstance(b, SparseStream) else b
    if a.numel() == 0 or t.numel() == 0 or a.device != t.device:
        return False
    return a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _check_finite(comm: Communicator, bucket: Bucket, g: torch.Tensor) -> None:
    bad = [i for i, part in enumerate(g.split(list(bucket.sizes))) if not all_finite(part)]
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


def _warn_nonfinite(bucket: Bucket) -> None:
    log.warning(
        "NaN/Inf gradient at step %d (bucket %s): reduced densely, the average "
        "is non-finite (nan_policy='propagate')",
        bucket.step,
        bucket.names[0] if bucket.names else "?",
    )


def _dense_for_nonfinite(comm: Communicator, bucket: Bucket, g: torch.Tensor) -> torch.Tensor:
    """``nan_policy="propagate"``: the bucket's dense sum, NaN/Inf where dense has them."""
    _warn_nonfinite(bucket)
    return comm.allreduce(g)


def _any_nonfinite(comm: Communicator, g: torch.Tensor) -> bool:
    """Whether any rank's bucket holds NaN/Inf (a collective: every rank gets the answer)."""
    bad = torch.tensor([0 if all_finite(g) else 1], dtype=torch.int64)
    return bool(int(comm.allreduce(bad)))


def reduce_bucket(state: SparcmlState, bucket: Bucket) -> torch.Tensor:
    """Steps 0-7 above for one bucket; returns the averaged flat gradient.

    Step 0: with layer rules, the bucket's parameters are grouped by the group
    that reduces them (``state.routes``), and each group runs steps 1-7 with its
    own method, in the order of its first parameter (the same on every rank).
    """
    comm = state.comm
    before = comm.stats.bytes_sent
    state.at_step(bucket.step)
    try:
        routes = state.routes(bucket.names, bucket.sizes, bucket.step)
        if len(routes) == 1:
            return reduce_group(routes[0][0], bucket)
        flat = bucket.grad.reshape(-1)
        offsets = [0]
        for size in bucket.sizes:
            offsets.append(offsets[-1] + size)
        out = torch.empty_like(flat)
        for group, where in routes:
            parts = [flat[offsets[i] : offsets[i + 1]] for i in where]
            sub = Bucket(
                tuple(bucket.names[i] for i in where),
                tuple(bucket.sizes[i] for i in where),
                torch.cat(parts) if len(parts) > 1 else parts[0],
                bucket.step,
            )
            avg = reduce_group(group, sub)
            for i, part in zip(where, avg.split(list(sub.sizes)), strict=True):
                out[offsets[i] : offsets[i + 1]] = part
        return out
    finally:
        count_bytes(state, bucket.step, comm.stats.bytes_sent - before)


def count_bytes(state: SparcmlState, step: int, sent_bytes: int) -> None:
    """Add one bucket's bytes to the state's counters (total and per step)."""
    state.bytes_sent += sent_bytes
    while len(state.step_bytes) <= step:
        state.step_bytes.append(0)
    state.step_bytes[step] += sent_bytes


def check_sparse_gradient_method(state: SparcmlState, name: str, numel: int, step: int) -> None:
    """Raise ``ValueError`` if the method that reduces parameter ``name`` at ``step``
    cannot take its sparse gradient (naming the parameter and the choices)."""
    group = state.group_of(name, numel, step)
    if not group.spec.sparse_gradients:
        raise ValueError(
            f"parameter {name!r} has a sparse gradient (nn.Embedding/EmbeddingBag with "
            f"sparse=True), which method {group.method!r} cannot reduce; sparse gradients "
            "go through 'nonzeros' or 'dense' (exact, as sparse streams) or a selector "
            "('topk', 'topk+natural', ...): route it with a layer rule, e.g. "
            f"SparcmlState(..., layers=[({name!r}, 'nonzeros')])"
        )


def reduce_sparse_gradient(state: SparcmlState, bucket: Bucket) -> torch.Tensor:
    """The average of one parameter's sparse COO gradient (``bucket.grad``, the
    parameter's shape), as a coalesced COO tensor of the same layout.

    Exact methods (``dense``, ``nonzeros``, and warm-up steps) reduce the stored
    entries exactly through the sparse allreduce, never densifying (SparCML sec.
    8.2's use case: sparse embeddings and linear models; what plain DDP does for
    sparse gradients, but with sparcml's algorithms). Selector methods keep a dense
    residual (error feedback needs one), select from ``residual + g`` and send the
    selection.
    """
    comm = state.comm
    before = comm.stats.bytes_sent
    state.at_step(bucket.step)
    try:
        name, numel = bucket.names[0], bucket.sizes[0]
        check_sparse_gradient_method(state, name, numel, bucket.step)
        return _reduce_sparse(state.group_of(name, numel, bucket.step), bucket)
    finally:
        count_bytes(state, bucket.step, comm.stats.bytes_sent - before)


def _stream_selector(group: Group, bucket: Bucket) -> Selector | None:
    """The selector of a method that may select from a sparse gradient's entries: no
    momentum or clipping, error feedback, the ``sparse`` method's collective with an
    algorithm that sums exactly (with or without a value quantizer); else None."""
    settings = group.settings
    if settings.momentum or settings.clip_norm is not None or not group.error_feedback:
        return None
    if group.spec.run is not run_sparse or keeps_k(getattr(group.config, "algorithm", "auto")):
        return None
    return selector_and_quantizer(group.operator(bucket.key))[0]


def _selection_is_the_gradient(group: Group, bucket: Bucket, g: torch.Tensor) -> bool:
    """A selector method (:func:`_stream_selector`) whose residual is known to be
    zero, given a sparse gradient with fewer stored entries than it keeps: it would
    select every non-zero and keep a zero residual, so this rank may send the
    gradient's non-zeros as they are, without densifying (beyond the papers). A
    rank-local decision: the collective it then calls is the one every other rank
    calls, quantizing the same selection alike (:func:`_reduce_whole_selection`; the
    residual never holds a quantizer's error: ``acc - TopK(acc)``, as
    :func:`reduce_group` keeps it)."""
    selector = _stream_selector(group, bucket)
    if selector is None:
        return False
    values = g.values()  # (the stored entries: rows times the dense dimensions)
    if not selector.takes_all_nonzeros(values.numel(), g.numel()):
        return False
    if group.settings.nan_policy == "unchecked" and not all_finite(values):
        return False  # (NaN - NaN is the residual reduce_group keeps: not zero)
    return group.feedback.known_zero(bucket.names, bucket.sizes, values)


def _residual_for_entries(group: Group, bucket: Bucket, g: torch.Tensor) -> torch.Tensor | None:
    """The stored residual of a ``topk`` bucket whose top-k may be taken from the
    entries of ``residual + g`` (:meth:`~sparcml.compress.topk.TopK.select_entries`)
    instead of the dense accumulator, with :func:`reduce_group`'s bits: a selector
    method of :func:`_stream_selector` whose selector is ``TopK``, a sparse
    float32/float64 CPU gradient of at least ``BRACKET_MIN`` entries (rows times the
    dense dimensions; where the dense selection is ``top_k_exact`` too), and a
    residual stored by an earlier step (:meth:`~sparcml.sgd.feedback.NamedBuffers.stored`:
    not after a checkpoint load, a reset or a rebuilt bucket, whose next step
    densifies); else None. :func:`_reduce_sparse` then takes this path where the
    residual's non-zeros and the gradient's entries hold at most :data:`ENTRIES_MAX`
    of the bucket, and the residual is updated in place.

    This is the step after a sparse gradient with ``k`` entries or more (or one with
    a residual left from such a step): :func:`reduce_group` would write the dense
    gradient, add the residual, select from all of it and scan the average back
    into a sparse gradient, four passes over the bucket; here one read of the
    residual finds its non-zeros and the rest is O(nnz) (beyond the papers). At
    2^20 rows, 15,000 of them every step: 24.0-25.2 ms a step densifying, 14.2-14.9
    ms from the entries (``benchmarks/engine_profile.py --sparse-gradient``,
    docs/training.md "A sparse gradient above k")."""
    selector = _stream_selector(group, bucket)
    if type(selector) is not TopK:
        return None
    values = g.values()
    if (
        g.device.type != "cpu"
        or values.dtype not in (torch.float32, torch.float64)  # (kept in their dtype)
        or g.numel() < BRACKET_MIN
        or not selector.spec.of(g.numel())
    ):
        return None
    return group.feedback.stored(bucket.names, bucket.sizes, values)


ENTRIES_MAX = 1 / 8
"""The largest share of a bucket that ``residual + g``'s entries may hold for the
top-k to be taken from them; beyond it the step densifies. One step of a
2^20-entry ``topk`` bucket with a 10,000-row gradient, one process, two runs
(``benchmarks/entries_fill.py``, docs/results/train/sparse_residual/entries_fill.txt):
with the residual's non-zeros at 1%, 6%, 15%, 25% and 50% of the bucket, from the
entries 0.27-0.37x, 0.43-0.46x, 0.43-0.58x, 0.75-0.94x and 0.74-1.35x the
densifying step's time; 1/8 stays clear of where it reaches 1."""


def _residual_rows(
    group: Group, bucket: Bucket, residual: torch.Tensor, g: torch.Tensor, budget: int
) -> torch.Tensor | None:
    """The sorted positions of the stored ``residual``'s non-zeros (NaN included):
    none, without reading it, when it is known to be zero; None when there are more
    than ``budget`` (counted first, without writing a position: a residual that fills
    the bucket would cost a large write for nothing)."""
    if budget < 0:
        return None
    if group.feedback.known_zero(bucket.names, bucket.sizes, g.values()):
        return torch.empty(0, dtype=torch.int64, device=residual.device)
    if count_above(residual, 0.0) > budget:
        return None
    return select_above(residual, 0.0)


def _reduce_whole_selection(
    group: Group,
    bucket: Bucket,
    g: torch.Tensor,
    shape: tuple[int, ...],
    sparse_dim: int,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 2-7 of :func:`reduce_group` for a sparse gradient, on its entries.

    Without ``residual``: a selection that is all of the gradient's non-zeros
    (:func:`_selection_is_the_gradient`), the residual left zero. With the stored
    ``residual`` (:func:`_residual_for_entries`) and the positions of its non-zeros
    (``rows``, :func:`_residual_rows`): step 4's ``acc = residual + g``
    on the union of their non-zeros (summed in that order, as
    :meth:`~sparcml.sgd.feedback.ErrorFeedback.compensate_bucket` adds them), its
    top-k taken from those entries, and step 6's ``residual = acc - TopK(acc)``
    written where ``acc`` has entries.

    Either way the same NaN/Inf agreement, the same collective
    (:func:`~sparcml.torch.methods.sparse.allreduce_selection`), and the average
    with the entries :func:`reduce_group`'s dense result would keep (no zeros),
    bit for bit: a rank may take this path while another densifies."""
    comm, settings, p = group.comm, group.settings, group.comm.world_size
    before = comm.stats.bytes_sent
    t0 = time.perf_counter()
    stream = SparseStream.from_torch_sparse(g)
    acc: SparseStream | None = None
    covering = True
    if residual is None:
        # (NaN kept, -0.0 not: what a top-k selects)
        selected = _without_zeros(stream.indices, stream.values, stream.size)
    else:
        # Step 4 on the entries: -0.0 + r + g is r + g, bit for bit (merge_sum)
        assert rows is not None
        idx, vals = merge_sum([rows, stream.indices], [residual[rows], stream.values])
        acc = SparseStream.from_sorted(idx, vals, stream.size)
        selector = _stream_selector(group, bucket)
        assert isinstance(selector, TopK)
        selected, covering = selector.select_entries(_without_zeros(idx, vals, stream.size))
    select_s = time.perf_counter() - t0
    try:
        # Step 2 as reduce_group takes it (raise: one flag allreduce of the gradient;
        # propagate: the collective's header, flagged where the accumulator is not
        # finite, as run_sparse flags it)
        if settings.nan_policy == "raise":
            _check_finite(
                comm, Bucket(bucket.names, (stream.nnz,), stream.values, bucket.step),
                stream.values,
            )  # fmt: skip
        checked = selected.values if acc is None else acc.values
        nonfinite = settings.nan_policy == "propagate" and not all_finite(checked)
        if nonfinite:
            selected = SparseStream.empty(stream.size, stream.dtype, stream.device)
        try:
            total = allreduce_selection(group, bucket, selected, nonfinite)
        except NonFiniteError:
            if settings.nan_policy != "propagate":
                raise
            avg = _dense_for_nonfinite(comm, bucket, g.to_dense().reshape(-1)) / p
            return SparseStream.from_dense(avg).to_torch_sparse(shape, sparse_dim)
        if acc is not None:
            # Step 6 (unsent entries keep acc's value; a covering selection of finite
            # values leaves zeros, which the next step need not read)
            group.feedback.update_entries(
                bucket.names, bucket.sizes, acc, selected,
                covering and all_finite(selected.values),
            )  # fmt: skip
        # Step 7 as reduce_group does it, and the non-zeros _reduce_sparse keeps of it
        if total.is_dense:
            avg = SparseStream.from_dense(total.to_dense() / p)
        else:
            avg = _without_zeros(total.indices, total.values / p, total.size)
            if avg.nnz > dense_threshold(avg.size, avg.dtype):
                avg = SparseStream.from_dense(avg.to_dense())  # (from_dense's dense case)
        return avg.to_torch_sparse(shape, sparse_dim)
    finally:
        group.stats.record(
            bucket.step, g.numel(), comm.stats.bytes_sent - before,
            2 * (p - 1) / p * g.numel() * g.element_size(), select_s,
            max(0.0, time.perf_counter() - t0 - select_s), selected.nnz,
            k_of(group.density, g.numel()) if group.density is not None else None,
        )  # fmt: skip


def _without_zeros(indices: torch.Tensor, values: torch.Tensor, size: int) -> SparseStream:
    """The pairs whose value is not zero (NaN kept, -0.0 not), as a stream; without
    copies when none is zero (the usual case)."""
    return SparseStream.from_sorted(*drop_zeros(indices, values), size)


def _reduce_sparse(group: Group, bucket: Bucket) -> torch.Tensor:
    g = bucket.grad.detach().coalesce()
    shape, sparse_dim = tuple(g.shape), g.sparse_dim()
    settings = group.settings
    selects = not group.spec.lossless and bucket.step >= settings.warmup_steps
    if selects and _selection_is_the_gradient(group, bucket, g):
        return _reduce_whole_selection(group, bucket, g, shape, sparse_dim)
    if selects and (residual := _residual_for_entries(group, bucket, g)) is not None:
        budget = int(g.numel() * ENTRIES_MAX) - g.values().numel()
        rows = _residual_rows(group, bucket, residual, g, budget)
        if rows is not None:
            return _reduce_whole_selection(group, bucket, g, shape, sparse_dim, residual, rows)
    if settings.momentum or selects:
        flat = g.to_dense().reshape(-1)
        avg = reduce_group(group, Bucket(bucket.names, bucket.sizes, flat, bucket.step))
        return SparseStream.from_dense(avg).to_torch_sparse(shape, sparse_dim)
    comm = group.comm
    p = comm.world_size
    before = comm.stats.bytes_sent
    t0 = time.perf_counter()
    try:
        stream = SparseStream.from_torch_sparse(g)
        if settings.nan_policy == "raise":
            _check_finite(
                comm, Bucket(bucket.names, (stream.nnz,), stream.values, bucket.step), stream.values
            )
        # warm-up steps of a selector method are exact too: its algorithm may not be
        algorithm = getattr(group.config, "algorithm", "auto") if group.spec.lossless else "auto"
        total = sparse_allreduce(stream, comm, algorithm=algorithm, call_id=bucket.step)
        if total.is_dense:
            total = SparseStream.from_dense(total.to_dense())
        avg = SparseStream.from_sorted(total.indices, total.values / p, total.size)
        return avg.to_torch_sparse(shape, sparse_dim)
    finally:
        group.stats.record(
            bucket.step, g.numel(), comm.stats.bytes_sent - before,
            2 * (p - 1) / p * g.numel() * g.element_size(), 0.0,
            time.perf_counter() - t0, None, None,
        )  # fmt: skip


def _work_dtype(group: Group, g: torch.Tensor) -> torch.dtype:
    """The dtype residuals and momenta are kept in (``residual_precision``)."""
    if group.settings.residual_precision == "float32" and g.dtype in (
        torch.float16,
        torch.bfloat16,
    ):
        return torch.float32
    return g.dtype


def reduce_group(
    group: Group, bucket: Bucket, bounds: list[int] | None = None, average: bool = True
) -> torch.Tensor:
    """Steps 1-7 for one bucket whose parameters all belong to ``group``.

    Returns the average over ranks (flat), or with ``average=False`` the sum (step 7
    left to the caller: the one-tensor SGD steps return Alg. 1's ``g``). With
    ``bounds`` (FSDP2's chunk boundaries, ``P + 1`` offsets) step 5 is the method's
    reduce-scatter and the result is this rank's chunk of the sum (FSDP applies its
    own division).
    """
    comm = group.comm
    settings = group.settings
    spec = group.spec
    p = comm.world_size
    g = bucket.grad.detach().reshape(-1)
    before = comm.stats.bytes_sent
    t0 = time.perf_counter()
    compress_s = 0.0
    sent: torch.Tensor | SparseStream | None = None
    try:
        # Step 1: dense warm-up.
        if bucket.step < settings.warmup_steps or spec.reference:
            if settings.nan_policy == "raise":
                _check_finite(comm, bucket, g)
            if bounds is not None:
                # (warm-up under FSDP2: the dense chunks through the split)
                result = scatter_dense(group, bucket, g, bounds)
                compress_s = result.select_s
                assert isinstance(result.total, torch.Tensor)
                return result.total
            if settings.momentum:
                # with momentum correction the optimizer has no momentum: warm-up
                # steps (and a layer rule's dense parameters) are dense momentum
                # SGD, u = m u + g, averaged (no masking)
                work = g.to(_work_dtype(group, g))
                u = group.momentum_correction.accumulate(bucket.names, bucket.sizes, work)
                group.momentum_correction.keep(bucket.names, bucket.sizes, u)
                total = comm.allreduce(u.to(g.dtype))
                return (total / p).to(g.dtype) if average else total
            total = comm.allreduce(g)
            return total / p if average else total
        # Step 2: NaN policy.
        if settings.nan_policy == "raise":
            _check_finite(comm, bucket, g)
        elif (
            settings.nan_policy == "propagate"
            and not spec.lossless
            # (FSDP2's reduce-scatters carry no NaN flag: always agreed first)
            and (bounds is not None or not (spec.checks_nonfinite or spec.carries_nonfinite))
            and _any_nonfinite(comm, g)
        ):
            # propagate: compressed methods cannot place NaN/Inf where dense would
            # (selectors may drop them into the residual, quantizers cannot encode
            # them): this bucket goes dense for this step, residuals untouched
            if bounds is not None:
                _warn_nonfinite(bucket)
                result = scatter_dense(group, bucket, g, bounds)
                assert isinstance(result.total, torch.Tensor)
                return result.total
            total = _dense_for_nonfinite(comm, bucket, g)
            return total / p if average else total
        t_local = time.perf_counter()
        # Step 3: local gradient clipping (DGC: threshold scaled by P^-1/2).
        if settings.clip_norm is not None and settings.clip_scope == "bucket":
            limit = settings.clip_norm / math.sqrt(p)
            norm = float(torch.linalg.vector_norm(g.double())) if g.numel() else 0.0
            if norm > limit:
                g = g * (limit / (norm + 1e-12))
        # Step 4: accumulation (residuals and momenta in float32 for 16-bit gradients
        # unless residual_precision="gradient"; what is sent stays in g's dtype).
        names, sizes = bucket.names, bucket.sizes
        work = g.to(_work_dtype(group, g))
        after = bool(settings.momentum) and spec.lossless  # momentum after the exact sum
        source = work  # (acc is source itself when the residual is known to be zero)
        if settings.momentum and not after:
            u = source = group.momentum_correction.accumulate(names, sizes, work)
            acc = group.feedback.compensate_bucket(names, sizes, u) if group.error_feedback else u
        elif group.error_feedback:
            acc = group.feedback.compensate_bucket(names, sizes, work)
        else:
            acc = g.clone()
        send = acc if acc.dtype == g.dtype else acc.to(g.dtype)
        compress_s = time.perf_counter() - t_local
        # Step 5: the method's collective (sparcml.torch.methods).
        try:
            if bounds is None:
                result = spec.run(group, bucket, send)
            else:
                assert spec.scatter is not None
                result = spec.scatter(group, bucket, send, bounds)
        except NonFiniteError:
            # (checks_nonfinite: refused on every rank before any state changed)
            if settings.nan_policy != "propagate" or not spec.checks_nonfinite:
                raise
            total = _dense_for_nonfinite(comm, bucket, g)
            return total / p if average else total
        sent, total = result.sent, result.total
        compress_s += result.select_s
        # Step 6: residuals (and momentum factor masking), in place on acc where
        # only the sent entries change (acc is ours unless the sum is a view of it,
        # or acc is the gradient or momentum itself: a residual known to be zero).
        # Every non-zero sent with its exact value (covering): the residual is zero;
        # one that already was is left as it is, and the next step skips reading it.
        if group.error_feedback:
            assert sent is not None
            # (NaN/Inf sent under nan_policy="unchecked" leave NaN - NaN behind)
            covering = result.covering and send is acc
            if covering and isinstance(sent, SparseStream):
                covering = all_finite(sent.values)
            if covering and acc is source:
                pass  # zero before, zero after: nothing to write
            else:
                if acc is source or _shares_memory(acc, total) or _shares_memory(acc, sent):
                    acc = acc.clone()
                group.feedback.update_bucket(names, sizes, acc, sent, covering)
            if settings.momentum:
                group.momentum_correction.keep(names, sizes, u, sent)
        elif settings.momentum and not after:
            group.momentum_correction.keep(names, sizes, u)  # every entry was sent
        if bounds is not None or not average:
            # Step 7 is the caller's (FSDP's reduce op, Alg. 1's g)
            return total.to_dense() if isinstance(total, SparseStream) else total
        # Step 7: the average (a lossless method's momentum applied to it); a sparse
        # sum divided on its entries before densifying (O(nnz), zeros stay zeros:
        # the bits of the dense division without its pass over the bucket)
        if isinstance(total, SparseStream) and not total.is_dense and not spec.averages:
            avg = SparseStream.from_sorted(total.indices, total.values / p, total.size).to_dense()
        else:
            dense = total.to_dense() if isinstance(total, SparseStream) else total
            avg = dense if spec.averages else dense / p
        if after:
            u = group.momentum_correction.accumulate(names, sizes, avg.to(work.dtype))
            group.momentum_correction.keep(names, sizes, u)
            return u.to(g.dtype)
        return avg.to(g.dtype)
    finally:
        elapsed = time.perf_counter() - t0
        selected = k = None
        density = group.density
        if isinstance(sent, SparseStream) and not sent.is_dense and density is not None:
            selected = sent.nnz
            k = k_of(density, g.numel())
        # a dense ring allreduce sends 2 (P-1)/P of the bucket, a reduce-scatter half
        ring = (p - 1) / p * g.numel() * (bucket.itemsize or g.element_size())
        group.stats.record(
            bucket.step,
            g.numel(),
            comm.stats.bytes_sent - before,
            ring if bounds is not None else 2 * ring,
            compress_s,
            max(0.0, elapsed - compress_s),
            selected,
            k,
        )
