"""Ok-Topk: the O(k) sparse allreduce of Li and Hoefler (PPoPP'22, paper 001).

Input: every rank's accumulator ``acc`` (dense, after error feedback) and ``k``.

1. **Local top-k by threshold.** The exact k-th largest ``|acc|`` is computed every
   ``tau_prime`` calls and reused in between; the selection is ``|acc| >= t_local``.
2. **Balanced split.** ``P`` contiguous regions of the index space whose
   boundaries put about the same number of the ranks' selected entries in every
   region. Re-estimated every ``tau`` calls: every rank sends ``Q`` quantiles of
   its selected positions (and its count) to all; all ranks merge the same
   weighted samples and cut at equal shares, so they agree on the boundaries.
3. **Split and reduce.** Each rank sends its entries of region ``j`` to rank ``j``,
   destinations rotated (``r+1, r+2, ...``) to avoid hot spots; rank ``j`` sums
   what it receives, in rank order.
4. **Global top-k.** Each rank keeps the entries of its reduced region with
   ``|v| >= t_global``, the k-th largest magnitude over all reduced regions. It is
   recomputed every ``tau_prime`` calls, exactly, by a distributed radix select
   on the float32 bit patterns (4 allreduces of a 256-bin histogram: no values
   travel), and reused in between. Ties at the threshold are all kept.
5. **Balanced allgather.** Counts first (one allgather of ``P`` integers); then the
   kept entries are redistributed so every rank holds an equal share of their
   concatenation (only the non-empty overlaps travel, point to point: every rank
   can tell them from the counts); then a recursive-doubling allgather of those
   shares. Every rank concatenates the same bytes in region order.

Output: the global sparse result (bitwise identical on every rank) and, per rank,
the positions of its local selection that are in the result, for Ok-Topk SGD's
residual update ``eps = acc - acc(indexes)``.

With ``OkTopkState(two_level=True)`` on ranks that span several nodes of several
ranks (:attr:`~sparcml.comm.Communicator.topology`), steps 3 and 5 run in two levels
(:func:`~sparcml.collectives.reduce_scatter`,
:func:`~sparcml.collectives.sparse_allgather.allgather_buffers_on_nodes`): inside the
node, then one lane per local rank between nodes (beyond the paper, which is flat;
off by default, measured slower at 1 Gbit/s: see :class:`OkTopkState`).

Cost: ``(2P + 2 log2 P) alpha + [2k, 6k] (P-1)/P beta`` (slides: "Total Cost <=
(2p + 2 lg p) alpha + 6k (p-1)/p beta"); split-and-reduce alone
``(P-1) alpha + 2k (P-1)/P beta``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..comm import Communicator, resolve
from ..comm.abort import mark_uniform
from ..compress.selection import select_above
from ..compress.threshold_reuse import kth_largest, kth_magnitude
from ..errors import RankMismatchError
from ..merge import merge_positions
from ..reinterpret import as_bytes, bytes_as, index_low_bytes, indices_from_low_bytes
from ..stream import SparseStream, index_bytes
from ._common import log2_ceil, split_and_reduce
from .codec import EXACT, StreamCodec
from .headers import CallSettings, check_consistent, state_variant
from .reduce_scatter import reduce_scatter
from .registry import register
from .sparse_allgather import allgather_buffers, allgather_buffers_on_nodes

if TYPE_CHECKING:
    from ..costmodel import CostModel

__all__ = ["OkTopkResult", "OkTopkState", "oktopk", "oktopk_allreduce"]


@dataclasses.dataclass
class OkTopkState:
    """Ok-Topk's state across calls (one per tensor), with its hyperparameters.

    Attributes:
        tau: calls between re-estimations of the region boundaries.
        tau_prime: calls between exact recomputations of the local and global
            thresholds (reused in between).
        quantiles: quantiles of its selected positions each rank contributes to
            the boundary estimate.
        calls: calls so far.
        local_threshold, global_threshold, boundaries: the reused values.
        last_local_indices: positions of this rank's selection in the last result.
        last_send_bytes: bytes this rank sent in the last call's split phase.
        two_level: on ranks that span several nodes of several ranks, run steps 3
            and 5 in two levels (inside the node, then between nodes; beyond the
            paper). Off by default: at 2 x 4 ranks on 1 Gbit/s NICs it was slower
            than flat (docs/cluster.md, "Nodes with several ranks"): Ok-Topk's
            O(k) traffic does not fill the NIC, and two levels add rounds.
    """

    tau: int = 64
    tau_prime: int = 32
    quantiles: int = 16
    calls: int = 0
    local_threshold: float | None = None
    global_threshold: float | None = None
    boundaries: list[int] | None = None
    last_local_indices: torch.Tensor | None = None
    last_send_bytes: int = 0
    two_level: bool = False

    def __post_init__(self) -> None:
        if self.tau < 1 or self.tau_prime < 1 or self.quantiles < 1:
            raise ValueError(
                f"tau, tau_prime and quantiles must be >= 1, got {self.tau}, "
                f"{self.tau_prime}, {self.quantiles}"
            )


@dataclasses.dataclass
class OkTopkResult:
    """The global result and this rank's selected positions that are in it."""

    stream: SparseStream
    local_indices: torch.Tensor


def _balanced_boundaries(
    selected: torch.Tensor, size: int, comm: Communicator, q: int
) -> list[int]:
    """Step 2: region boundaries with about equal shares of all ranks' selections."""
    p = comm.world_size
    n = selected.numel()
    if n:
        # (integer positions: float32 linspace rounds past n - 1 from n = 2^25 on)
        i, d = torch.arange(q, device=selected.device), max(q - 1, 1)
        pos = (2 * i * (n - 1) + d) // (2 * d)  # i (n - 1) / (q - 1), rounded
        sample = selected[pos].to(torch.int64).cpu()
    else:
        sample = torch.full((q,), -1, dtype=torch.int64)
    row = torch.cat([torch.tensor([n], dtype=torch.int64), sample])
    with comm.control():  # P x (q + 1) integers, whatever the vector's length
        rows = comm.allgather(row)
    # Each quantile of rank r stands for n_r / q of its selected entries.
    points = torch.cat([r[1:] for r in rows])
    weights = torch.cat([torch.full((q,), float(r[0]) / q, dtype=torch.float64) for r in rows])
    keep = points >= 0
    points, weights = points[keep], weights[keep]
    if points.numel() == 0:
        return [j * size // p for j in range(p + 1)]
    order = torch.argsort(points, stable=True)
    points, cum = points[order], torch.cumsum(weights[order], 0)
    total = float(cum[-1])
    targets = torch.tensor([total * j / p for j in range(1, p)], dtype=torch.float64)
    cut = torch.searchsorted(cum, targets).clamp(max=points.numel() - 1)
    inner = (points[cut] + 1).clamp(0, size).tolist()
    bounds = [0, *[int(b) for b in inner], size]
    for j in range(1, p + 1):  # keep them non-decreasing
        bounds[j] = max(bounds[j], bounds[j - 1])
    return bounds


def _global_kth(values: torch.Tensor, k: int, comm: Communicator) -> tuple[float, list[int] | None]:
    """Step 4: the exact k-th largest ``|v|`` over every rank's ``values``, and how many
    of each rank's values reach it.

    Non-negative float magnitudes order like their integer bit patterns, so a
    distributed radix select on the bit pattern finds the largest ``t`` with
    ``count(|v| >= t) >= k`` exactly, moving no values: one 256-bin histogram per
    byte of the pattern, 4 rounds for float32 (float16 and bfloat16 are exact in
    float32), 8 for float64 (a bisection on the bits would take 31 allreduces of one
    count). The first rounds allreduce the histogram; the last one allgathers every
    rank's histogram with its count above the prefix so far (beyond the paper: every
    rank then knows every rank's count ``|v| >= t``, which step 5 needs, without an
    allgather of its own). NaN counts as +inf; fewer than ``k`` entries in all give
    ``(0, None)``.

    Cost: ``3 T_allreduce(256 int64) + T_allgather(257 int64)`` plus ``O(n)`` local
    work in the first round (later rounds scan only the entries whose high bytes
    match).
    """
    if values.dtype == torch.float64:
        bits = values.abs().contiguous().view(torch.int64).clamp(max=0x7FF0000000000000)
        fdtype, idtype, shifts = torch.float64, torch.int64, list(range(56, -1, -8))
    else:
        bits = values.abs().float().contiguous().view(torch.int32).clamp(max=0x7F800000)
        fdtype, idtype, shifts = torch.float32, torch.int32, list(range(24, -1, -8))
    remaining, prefix, above = k, 0, 0
    counts: list[int] | None = None
    for r, shift in enumerate(shifts):
        digit = ((bits >> shift) & 0xFF).to(torch.int64)
        mine = torch.bincount(digit, minlength=256).to(device="cpu", dtype=torch.int64)
        with comm.control():  # 256-bin histograms, whatever the vector's length
            if r < len(shifts) - 1:
                hist = comm.allreduce(mine)
            else:
                rows = comm.allgather(torch.cat([mine, torch.tensor([above])]))
        if r == len(shifts) - 1:
            hist = torch.stack([row[:256] for row in rows]).sum(0)
        if r == 0 and int(hist.sum()) < k:
            return 0.0, None
        from_top = hist.flip(0).cumsum(0)
        j = int(torch.searchsorted(from_top, torch.tensor([remaining])).item())
        b = 255 - j
        remaining -= int(from_top[j]) - int(hist[b])
        prefix |= b << shift
        if r < len(shifts) - 1:
            above += int(mine[b + 1 :].sum())
            bits = bits[digit == b]
        else:
            counts = [int(row[256]) + int(row[b:256].sum()) for row in rows]
    return float(torch.tensor([prefix], dtype=idtype).view(fdtype)), counts


def _in_sorted(sub: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
    """Which entries of the sorted unique ``sub`` also lie in the sorted unique ``sup``
    (a linear merge, :func:`sparcml.merge.merge_positions`, instead of ``isin``)."""
    if sub.numel() == 0 or sup.numel() == 0:
        return torch.zeros(sub.numel(), dtype=torch.bool, device=sub.device)
    union, pos = merge_positions([sub, sup])
    hit = torch.zeros(union.numel(), dtype=torch.bool, device=sub.device)
    hit[pos[sub.numel() :]] = True
    return hit[pos[: sub.numel()]]


def oktopk_allreduce(
    acc: torch.Tensor,
    k: int,
    comm: Communicator | None = None,
    state: OkTopkState | None = None,
    codec: StreamCodec = EXACT,
    check: bool = True,
) -> OkTopkResult:
    """Ok-Topk's sparse allreduce of the ranks' accumulators (steps 1-5 above).

    Args:
        acc: this rank's accumulator (any shape; flattened), same size on every rank.
        k: entries to select locally and to keep globally (>= 1).
        comm: the communicator (default: the default process group, or a world of one).
        state: thresholds and boundaries reused across calls (one per tensor);
            default a fresh state (every call then recomputes everything).
        codec: how the split-phase messages are encoded (exact by default).
        check: first check that every rank passes the same size and dtype (one tiny
            message to every peer; a mismatch raises on every rank).

    Returns:
        :class:`OkTopkResult`: the global result (same bits on every rank) and this
        rank's selected positions that are in it.

    Raises:
        ValueError: ``k`` out of range.
        RankMismatchError: ranks passed different sizes or dtypes.
    """
    comm = resolve(comm)
    state = state if state is not None else OkTopkState()
    x = acc.detach().reshape(-1)
    if not check:  # inside sparse_allreduce, which checked already
        return _oktopk(x, k, comm, state, codec)

    def call() -> OkTopkResult:
        number = comm.next_sequence()
        with comm.in_call(number):
            # k, the codec and the state's settings in the header: a difference between
            # ranks is refused on every rank, naming it
            settings = CallSettings.of(
                "oktopk", codec.quantizer, codec.quantize if codec.quantizer else "dense",
                codec.index_coding, {"k": k},
            )  # fmt: skip
            settings = dataclasses.replace(settings, variant=state_variant(state))
            check_consistent(
                SparseStream.dense(x), comm, sequence=number, lossy=codec.lossy,
                settings=settings,
            )  # fmt: skip
            return _oktopk(x, k, comm, state, codec)

    # in submission order with the engine's queued calls (sparse_allreduce's
    # async_op): one call at a time on the communicator, numbered in that order
    out = comm.run_ordered(call, False)
    assert isinstance(out, OkTopkResult)
    return out


def _oktopk(
    x: torch.Tensor, k: int, comm: Communicator, state: OkTopkState, codec: StreamCodec
) -> OkTopkResult:
    """Steps 1-5 on the flat accumulator ``x`` (:func:`oktopk_allreduce`)."""
    n = x.numel()
    if not 1 <= k <= max(n, 1):
        raise ValueError(f"oktopk: k must lie in [1, {n}], got {k}")
    if n == 0:  # (every rank: k was agreed, N is in the header)
        state.calls += 1
        return OkTopkResult(
            SparseStream.empty(0, x.dtype, x.device), x.new_zeros(0, dtype=torch.int64)
        )
    p, me = comm.world_size, comm.rank
    refresh = state.calls % state.tau_prime == 0 or state.local_threshold is None
    # Step 1: local top-k by a (reused) threshold
    if refresh:
        state.local_threshold = kth_magnitude(x, k)
    idx = select_above(x, state.local_threshold, strict=state.local_threshold == 0)
    if not refresh and not _near_k(idx.numel(), k):
        # count guard (the authors' code nudges the threshold when the count leaves
        # [3k/4, 5k/4]): the exact threshold now, a local pass only; over the
        # selection alone when it holds k or more (the k-th largest is among them)
        state.local_threshold, idx = _exact_again(x, idx, k)
    local = SparseStream.from_sorted(idx, x[idx], n)
    # Step 2: balanced split, re-estimated every tau calls
    if state.boundaries is None or state.calls % state.tau == 0 or len(state.boundaries) != p + 1:
        state.boundaries = _balanced_boundaries(idx, n, comm, state.quantiles)
    bounds = state.boundaries
    if bounds[-1] != n:
        mismatch = RankMismatchError(f"oktopk: boundaries end at {bounds[-1]}, the vector has {n}")
        raise mark_uniform(mismatch, False)  # seen here only: tell the others
    # Step 3: split and reduce (alltoallv sends to r+1, r+2, ... first); with
    # state.two_level on nodes of several ranks, inside the node, then between nodes
    if state.two_level:
        before = comm.stats.bytes_sent
        region = reduce_scatter(local, comm, codec, bounds)
        state.last_send_bytes = comm.stats.bytes_sent - before
    else:
        region, _, state.last_send_bytes = split_and_reduce(local, comm, codec, bounds)
    # Step 4: global top-k by a (reused) global threshold
    counts: list[int] | None = None
    if refresh or state.global_threshold is None:
        state.global_threshold, counts = _global_kth(region.values, k, comm)
    # (a zero threshold, fewer than k entries in all, keeps the non-zeros only: a
    # region that went dense holds zeros that nobody selected)
    t_global = state.global_threshold
    keep = select_above(region.values, t_global, strict=t_global == 0)
    # Step 5: balanced allgather: counts (from the threshold's last round after a
    # refresh), equal shares, allgather of the shares
    if counts is None:
        counts = _allgather_count(int(keep.numel()), comm)
        if not refresh and not _near_k(sum(counts), k):
            # the same guard on the global selection (every rank sees the same counts,
            # so every rank takes the same branch): an exact threshold now, with the
            # counts; with k or more kept in all, the k-th largest is among the kept
            if sum(counts) >= k:
                sub = keep
                t_global, counts = _global_kth(region.values[sub], k, comm)
                keep = sub[_at_least(region.values[sub], t_global)]
            else:
                t_global, counts = _global_kth(region.values, k, comm)
                keep = select_above(region.values, t_global, strict=t_global == 0)
            state.global_threshold = t_global
            if counts is None:
                counts = _allgather_count(int(keep.numel()), comm)
    # (kept as raw pairs, never a stream: a stream past delta would turn dense over
    # the whole N and claim positions of other ranks' regions)
    kept_idx = region.indices[keep] + bounds[me]
    indices, values = _balanced_allgather(
        kept_idx, region.values[keep], n, comm, counts, state.two_level
    )
    state.calls += 1
    state.last_local_indices = idx[_in_sorted(idx, indices)]
    return OkTopkResult(SparseStream.from_sorted(indices, values, n), state.last_local_indices)


def _at_least(values: torch.Tensor, t: float) -> torch.Tensor:
    """``|v| >= t`` (``> 0`` when ``t`` is 0), NaN included: :func:`select_above`'s test
    as a mask."""
    mag = torch.nan_to_num(values.abs(), nan=float("inf"))
    return mag > 0 if t == 0 else mag >= t


def _exact_again(x: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """The count guard's exact local threshold and selection.

    ``idx`` is the selection ``|x| >= t_old``. When it holds ``k`` or more entries,
    the k-th largest of all lies among them, so the threshold and the new selection
    come from ``x[idx]`` alone (``O(|idx|)``); else from the whole accumulator.
    Either way the result is that of a full recomputation, bit for bit.
    """
    if idx.numel() >= k:
        sel = x[idx]
        t = kth_largest(torch.nan_to_num(sel.abs(), nan=float("inf")), k)
        return t, idx[_at_least(sel, t)]
    t = kth_magnitude(x, k)
    return t, select_above(x, t, strict=t == 0)


def _near_k(count: int, k: int) -> bool:
    """The count guard's band: ``3k/4 <= count <= 5k/4``."""
    return 3 * k <= 4 * count <= 5 * k


def _allgather_count(nnz: int, comm: Communicator) -> list[int]:
    with comm.control():
        return [int(c) for c in comm.allgather(torch.tensor([nnz], dtype=torch.int64))]


def _balanced_allgather(
    kept_idx: torch.Tensor,
    kept_val: torch.Tensor,
    size: int,
    comm: Communicator,
    counts: list[int],
    two_level: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5: every rank ends with the concatenation of all ranks' kept entries
    (``counts``: every rank's number of kept entries, gathered first; ``two_level``:
    the final allgather in two levels on nodes)."""
    p, me = comm.world_size, comm.rank
    device = kept_val.device
    total = sum(counts)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    share = [j * total // p for j in range(p + 1)]  # rank j holds [share[j], share[j+1])

    def overlap(a: int, b: int) -> tuple[int, int]:
        """The part of rank a's kept entries that belongs to rank b's share."""
        return max(offsets[a], share[b]), min(offsets[a + 1], share[b + 1])

    # Redistribute: every rank knows all counts, so only the non-empty overlaps
    # travel (a rank's entries usually straddle one or two shares): point to point.
    # Receives first where the transport asks (``receives_first``): a rank that
    # both sends to and receives from j exchanges with it (``isend(after=)``), and
    # every receive has its body posted before any is waited for.
    sources = [j for j in range(p) if j != me and _nonempty(overlap(j, me))]
    first = comm.receives_first and p == 2  # (several peers: sends first, as alltoallv)
    recvs = {j: comm.irecv(j) for j in sources if first}
    sends = []
    for j in range(p):
        lo, hi = overlap(me, j)
        if j != me and hi > lo:
            sl = slice(lo - offsets[me], hi - offsets[me])
            payload = _pairs(kept_idx[sl], kept_val[sl], size)
            sends.append(comm.isend(payload, j, after=recvs.get(j)))
    if not first:
        recvs = {j: comm.irecv(j) for j in sources}
    for h in recvs.values():
        h.progress()
    pieces = []
    for j in range(p):  # my share, in source order = global order
        lo, hi = overlap(j, me)
        if hi <= lo:
            continue
        if j == me:
            sl = slice(lo - offsets[me], hi - offsets[me])
            pieces.append(_pairs(kept_idx[sl], kept_val[sl], size))
        else:
            got = recvs[j].wait()
            assert got is not None
            pieces.append(got.to(device))
    for h in sends:
        h.wait()
    held = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    # Allgather of the equal shares by recursive doubling (log2 P rounds); rank
    # order is region order, so the concatenation is sorted.
    blocks = allgather_buffers_on_nodes(held, comm) if two_level else allgather_buffers(held, comm)
    # (this rank's block is on its device, the received ones where the transport
    # delivered them)
    pairs = torch.cat([b.to(device) for b in blocks])
    indices, values = _unpairs(pairs, kept_val.dtype, size)
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        mismatch = RankMismatchError("oktopk: gathered entries out of order (do ranks agree on N?)")
        raise mark_uniform(mismatch, False)  # seen here only: tell the others
    return indices, values


def _nonempty(span: tuple[int, int]) -> bool:
    return span[1] > span[0]


def _pairs(indices: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Fixed-width records (``c``-byte index, value), so shares can be cut anywhere."""
    c = index_bytes(size)
    idx = index_low_bytes(indices, c).reshape(-1, c)
    val = as_bytes(values).reshape(-1, values.element_size())
    return torch.cat([idx, val], dim=1).reshape(-1)


def _unpairs(buf: torch.Tensor, dtype: torch.dtype, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = index_bytes(size)
    isize = dtype.itemsize
    rec = buf.reshape(-1, c + isize)
    # Columns of records are strided: both copies are compact, then reinterpreted.
    indices = indices_from_low_bytes(rec[:, :c].reshape(-1), c)
    values = bytes_as(rec[:, c:].reshape(-1), dtype)
    return indices, values


def refresh_cost(model: CostModel, p: int, n: int, k: int, isize: int) -> float:
    """One threshold refresh (every ``tau_prime`` calls): the exact local k-th largest
    over all ``N`` magnitudes (a pass for ``|acc|``, one for the selection), and the
    global radix select: ``32 / 8 = 4`` rounds of a 256-bin int64 histogram, three
    ring allreduces (``2(P-1)`` messages each) and one allgather that also carries
    every rank's count (``log2 P`` messages; it replaces step 5's count allgather),
    with a scan of the ``~k`` reduced entries per round."""
    hist = 256 * 8
    allreduce = 2 * (p - 1) * model.alpha + 2 * (p - 1) / p * hist * model.beta
    allgather = log2_ceil(p) * model.alpha + (p - 1) * (hist + 8) * model.beta
    count_allgather = (p - 1) * model.alpha
    return (
        2 * n * model.gamma_add + 3 * allreduce + allgather - count_allgather + 4 * model.gamma * k
    )


def boundaries_cost(model: CostModel, p: int, quantiles: int) -> float:
    """One re-estimation of the region boundaries (every ``tau`` calls): every rank
    sends ``Q`` quantiles and its count to every other rank."""
    return (p - 1) * (model.alpha + 8 * (quantiles + 1) * model.beta)


def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
    """Amortised over a threshold period (``OkTopkState``'s defaults ``tau' = 32``,
    ``tau = 64``): the steady state (thresholds and boundaries reused) -- the
    selection scan of the ``N``-element accumulator, split and reduce ((P-1) alpha,
    k (P-1)/P pairs), counts allgather ((P-1) alpha), share redistribution (<= 2
    messages of ~k/P), recursive-doubling allgather of the k kept pairs (log P alpha,
    k (P-1)/P pairs): paper 001 sec. 3.1-3.2, ``(2P + 2 log P) alpha + 6k (P-1)/P
    beta`` in words -- plus :func:`refresh_cost` / ``tau'`` and
    :func:`boundaries_cost` / ``tau``."""
    k = max(ks) if ks else 0
    pair = index_bytes(n) + isize
    steady = (
        (2 * (p - 1) + 2 + log2_ceil(p)) * model.alpha
        + model.beta_pairs * pair * (2 * k * (p - 1) / p + k / p)
        + model.gamma_add * n
        + model.gamma * 2 * k
    )
    defaults = OkTopkState()
    return (
        steady
        + refresh_cost(model, p, n, k, isize) / defaults.tau_prime
        + boundaries_cost(model, p, defaults.quantiles) / defaults.tau
    )


@register("oktopk", exact=False, input="accumulator", cost=cost, quadratic=True, family=("topk",))
def oktopk(
    stream: SparseStream,
    comm: Communicator | None = None,
    codec: StreamCodec = EXACT,
    k: int | None = None,
    state: OkTopkState | None = None,
) -> SparseStream:
    """``sparse_allreduce(acc, algorithm="oktopk", k=..., state=...)``: the global result.

    ``stream`` is the accumulator; the positions of this rank's selection in the
    result are left in ``state.last_local_indices``.

    Raises:
        ValueError: ``k`` missing.
    """
    if k is None:
        raise ValueError("algorithm 'oktopk' needs k= (and a state= kept across calls)")
    # sparse_allreduce has checked the ranks' sizes and dtypes already
    return oktopk_allreduce(stream.to_dense(), k, comm, state, codec, check=False).stream
