"""Ok-Topk and the sparse allreduce baselines it is measured against (paper 001).

Definitions checked, world sizes 1-9 and 16:

* topka / topkdsa: the dense sum of the local top-k sets;
* gtopk: its stage-by-stage definition (binomial tree, top-k re-selected at
  every merge, lower rank's set first), recomputed in one process;
* oktopk with tau = tau' = 1: sum the local top-k sets, keep the entries whose
  magnitude is at least the k-th largest magnitude of that sum. Ties: a local
  "top-k set" is every entry with |acc| >= its k-th largest magnitude, and every
  entry tied with the global k-th largest magnitude is kept (so with ties more
  than k entries may be selected). Integer-valued data makes ties frequent and
  sums exact, so the comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from sparcml import ErrorFeedback, OkTopkState, SparseStream, oktopk_allreduce, sparse_allreduce
from sparcml.collectives.gtopk import keep_topk
from sparcml.comm import run_ranks
from sparcml.compress.topk import TopK
from sparcml.torch import oktopk_sgd_step

WORLDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
N, K = 600, 25


def _acc(rank: int, n: int = N, integer: bool = True, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    x = (
        torch.randint(-50, 51, (n,), generator=g).float()
        if integer
        else torch.randn(n, generator=g)
    )
    if skew:  # all large values in the first 10% of the vector
        x = x * 0.01
        head = n // 10
        x[:head] = torch.randn(head, generator=g) * 10
    return x


def _local_topk(acc: torch.Tensor, k: int) -> SparseStream:
    """Every entry with |acc| >= the k-th largest magnitude (ties kept)."""
    t = torch.topk(acc.abs(), k).values.min()
    idx = (acc.abs() >= t).nonzero().flatten()
    return SparseStream(idx, acc[idx], acc.numel())


def _dense_sum(streams: list[SparseStream]) -> torch.Tensor:
    return torch.stack([s.to_dense().double() for s in streams]).sum(0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algorithm", ["topka", "topkdsa"])
def test_topka_and_topkdsa_equal_the_sum_of_local_sets(world: int, algorithm: str) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = _local_topk(_acc(comm.rank), K)
        return s, sparse_allreduce(s, comm, algorithm=algorithm)

    out = run_ranks(world, fn)
    ref = _dense_sum([o[0] for o in out])
    for _, res in out:
        assert res.equal(out[0][1])
        assert torch.equal(res.to_dense().double(), ref)


def _gtopk_reference(streams: list[SparseStream], k: int) -> SparseStream:
    sets = [keep_topk(s, k) for s in streams]
    p, d = len(sets), 1
    while d < p:
        for r in range(0, p, 2 * d):
            if r + d < p:
                sets[r] = keep_topk(sets[r] + sets[r + d], k)
        d *= 2
    return sets[0]


@pytest.mark.parametrize("world", WORLDS)
def test_gtopk_equals_its_stage_by_stage_definition(world: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = _local_topk(_acc(comm.rank, integer=False), K)
        return s, sparse_allreduce(s, comm, algorithm="gtopk")

    out = run_ranks(world, fn)
    ref = _gtopk_reference([o[0] for o in out], max(o[0].nnz for o in out))
    for _, res in out:
        assert res.equal(out[0][1])
    assert out[0][1].equal(ref)


@pytest.mark.parametrize("world", WORLDS)
def test_gtopk_keeps_the_selectors_k_when_selections_are_smaller(world: int) -> None:
    # TopK leaves the zeros out of a tensor with fewer non-zeros than k: 2 per rank
    # here, k = 4. The tree must keep k = 4 entries of the sum, not 2
    def fn(comm):  # type: ignore[no-untyped-def]
        x = torch.zeros(64)
        x[[comm.rank, 32 + comm.rank]] = torch.tensor([3.0, 1.0]) * (comm.rank + 1)
        s = TopK(k=4).select(x)
        return s, sparse_allreduce(s, comm, algorithm="gtopk", k=4)

    out = run_ranks(world, fn)
    assert all(o[0].nnz == 2 for o in out)
    ref = _gtopk_reference([o[0] for o in out], 4)
    for _, res in out:
        assert res.equal(out[0][1])
    assert out[0][1].equal(ref) and out[0][1].nnz == min(4, 2 * world)
    with pytest.raises(ValueError, match="k must be at least 0"):
        run_ranks(1, lambda comm: sparse_allreduce(out[0][0], comm, algorithm="gtopk", k=-1))


def _oktopk_reference(accs: list[torch.Tensor], k: int) -> tuple[torch.Tensor, list[set[int]]]:
    locals_ = [_local_topk(a, k) for a in accs]
    total = _dense_sum(locals_)
    support = torch.zeros(total.numel(), dtype=torch.bool)
    for s in locals_:
        support[s.indices] = True
    mags = total.abs()[support]
    t = torch.topk(mags, min(k, mags.numel())).values.min()
    keep = support & (total.abs() >= t)
    ref = torch.where(keep, total, torch.zeros_like(total))
    kept = set(keep.nonzero().flatten().tolist())
    return ref, [set(s.indices.tolist()) & kept for s in locals_]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("integer", [True, False])
def test_oktopk_with_tau_one_equals_the_definition(world: int, integer: bool) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        acc = _acc(comm.rank, integer=integer)
        return acc, oktopk_allreduce(acc, K, comm, OkTopkState(tau=1, tau_prime=1))

    out = run_ranks(world, fn)
    ref, kept_local = _oktopk_reference([o[0] for o in out], K)
    for r, (_, res) in enumerate(out):
        assert res.stream.equal(out[0][1].stream)  # bitwise identical on every rank
        assert set(res.local_indices.tolist()) == kept_local[r]
    got = out[0][1].stream.to_dense().double()
    if integer:
        assert torch.equal(got, ref)
    else:
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(got != 0, ref != 0)


def test_oktopk_reuses_thresholds_and_boundaries_on_schedule() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        st = OkTopkState(tau=4, tau_prime=2)
        seen = []
        for step in range(6):
            acc = _acc(comm.rank + 10 * step, integer=False)
            before = (st.local_threshold, st.global_threshold, st.boundaries)
            res = oktopk_allreduce(acc, K, comm, st)
            seen.append((before, (st.local_threshold, st.global_threshold, st.boundaries)))
            assert res.stream.nnz > 0
        return seen

    for seen in run_ranks(3, fn):
        for step, (before, after) in enumerate(seen):
            refreshed_thresholds = after[0] != before[0] and after[1] != before[1]
            assert refreshed_thresholds == (step % 2 == 0)
            assert (after[2] is not before[2]) == (step % 4 == 0)  # boundaries every tau


def test_oktopk_via_sparse_allreduce_and_errors() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        st = OkTopkState()
        acc = SparseStream.dense(_acc(comm.rank))
        res = sparse_allreduce(acc, comm, algorithm="oktopk", k=K, state=st)
        return res, st.last_local_indices

    out = run_ranks(3, fn)
    assert all(o[0].equal(out[0][0]) for o in out) and out[0][1] is not None
    with pytest.raises(ValueError, match="needs k="):
        sparse_allreduce(SparseStream.dense(torch.ones(5)), algorithm="oktopk")
    with pytest.raises(ValueError, match="has no option"):
        sparse_allreduce(SparseStream.dense(torch.ones(5)), algorithm="topka", k=3)
    with pytest.raises(ValueError, match=r"k must lie in \[1, 5\]"):
        oktopk_allreduce(torch.ones(5), 6)
    with pytest.raises(ValueError, match="tau"):
        OkTopkState(tau=0)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_bytes_oktopk_within_6k_and_topka_grows_with_p(world: int) -> None:
    n, k = 20_000, 200  # c = 2 index bytes + 4 value bytes: a pair is at most 2 words

    def fn(comm):  # type: ignore[no-untyped-def]
        st = OkTopkState(tau=1000, tau_prime=1000)
        sent = []
        for step in range(3):
            acc = _acc(comm.rank + 100 * step, n, integer=False)
            before = comm.stats.bytes_sent
            oktopk_allreduce(acc, k, comm, st)
            sent.append(comm.stats.bytes_sent - before)
        before = comm.stats.bytes_sent
        # the paper's pairs: sec. 5.1's fixed index fields (the default codes them smaller)
        sparse_allreduce(_local_topk(acc, k), comm, algorithm="topka", index_coding="fixed")
        return sent, comm.stats.bytes_sent - before

    out = run_ranks(world, fn)
    word = 4
    bound = 6 * k * (world - 1) / world * word
    overhead = 24 * 2 * world + 64  # stream headers of the split phase, the count words
    for sent, _ in out:
        # steps 1-2 reuse the thresholds and boundaries: the steady state Ok-Topk runs in
        assert max(sent[1:]) <= bound + overhead, (sent, bound)
    # TopkA: each rank receives and forwards the other P-1 selections of k pairs
    # (6 bytes each here, 2k(P-1) words of the slides' 2-word pairs)
    # plus, per other rank, its consistency header, its stream's wire header (24
    # bytes) and its bundle table entry (20 bytes)
    from sparcml.collectives.codec import HEADER_BYTES

    for _, topka_bytes in out:
        pairs = k * (world - 1) * 6
        assert pairs <= topka_bytes <= pairs + (world - 1) * (HEADER_BYTES + 24 + 20)


def test_balanced_split_with_skewed_indices() -> None:
    world, n, k = 8, 40_000, 400

    def fn(comm):  # type: ignore[no-untyped-def]
        st = OkTopkState(tau=1000, tau_prime=1000)
        oktopk_allreduce(_acc(comm.rank, n, integer=False, skew=True), k, comm, st)
        oktopk_allreduce(_acc(comm.rank + 50, n, integer=False, skew=True), k, comm, st)
        return st.last_send_bytes, st.boundaries

    out = run_ranks(world, fn)
    volumes = [o[0] for o in out]
    mean = sum(volumes) / world
    assert max(volumes) <= 1.5 * mean, volumes
    bounds = out[0][1]
    assert bounds[-2] < n // 10  # the regions crowd into the first 10% where the entries are


def test_oktopk_sgd_step_updates_the_residual() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        ef, st = ErrorFeedback(), OkTopkState(tau=1, tau_prime=1)
        grad = _acc(comm.rank, integer=False)
        u = oktopk_sgd_step(grad, "w", ef, st, K, comm, lr=0.5)
        acc = 0.5 * grad
        expect = acc.clone()
        expect[st.last_local_indices] = 0
        assert torch.equal(ef.residual("w"), expect)
        return u

    out = run_ranks(4, fn)
    assert all(torch.equal(u, out[0]) for u in out)


def test_oktopk_mismatched_sizes_fail_on_every_rank() -> None:
    from sparcml.errors import RankMismatchError

    def fn(comm):  # type: ignore[no-untyped-def]
        try:
            oktopk_allreduce(torch.randn(100 + (comm.rank == 1)), 5, comm)
        except RankMismatchError as e:
            return str(e)
        return "no error"

    assert all("rank 1: N=101" in m for m in run_ranks(3, fn))


def test_oktopk_with_k_above_the_nonzeros_keeps_only_them() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        acc = torch.zeros(50)
        acc[comm.rank] = 1.0 + comm.rank
        return oktopk_allreduce(acc, 10, comm, OkTopkState(tau=1, tau_prime=1)).stream

    out = run_ranks(4, fn)
    assert out[0].to_dense()[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert out[0].count_nonzero() == 4 and all(o.equal(out[0]) for o in out)


def test_bench_period_times_every_call_and_keeps_the_volume_bound() -> None:
    """``sparcml bench-topk``'s Ok-Topk period: tau' calls from a fresh state with a
    drifting accumulator (the count guard re-thresholds), the refresh first; every
    call's bytes within 6k(P-1)/P pairs."""
    from sparcml.stream import index_bytes
    from sparcml.tools.bench.topk import oktopk_period

    n, k, p = 1 << 14, 1500, 3  # k large enough that 4 histogram allreduces (11 kB) fit

    def fn(comm):  # type: ignore[no-untyped-def]
        acc = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        return [oktopk_period(comm, acc, k, seed=0, tau_prime=4, algorithm=a)
                for a in ("oktopk", "topkdsa")]  # fmt: skip

    for ok, dsa in run_ranks(p, fn):
        for period in (ok, dsa):
            assert len(period.times) == len(period.sent) == len(period.cpu) == 4
            assert period.err <= 1e-5  # each call's result checked against float64 sums
            assert k // 2 <= period.nnz <= p * k
        assert max(ok.sent) <= 6 * k * (p - 1) / p * (index_bytes(n) + 4)


def test_bench_period_error_sees_a_wrong_result() -> None:
    """The period's error is a real comparison: a result off by one entry shows."""
    from sparcml.tools.bench.topk import oktopk_error

    n = 64

    def fn(comm):  # type: ignore[no-untyped-def]
        x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        t = float(x.abs().kthvalue(n - 8).values)
        right = SparseStream.dense(comm.allreduce((x.abs() >= t).float() * x))
        wrong = SparseStream.dense(right.to_dense().clone())
        wrong.values[int(right.to_dense().abs().argmax())] += 1.0
        return oktopk_error(comm, x, right, t), oktopk_error(comm, x, wrong, t)

    for right, wrong in run_ranks(2, fn):
        assert right <= 1e-6 and wrong > 1e-3


@pytest.mark.parametrize("scale", [3.0, 0.3])
def test_count_guard_equals_a_full_recomputation(scale: float) -> None:
    """A drift that pushes the count out of [3k/4, 5k/4] (up: the exact thresholds
    come from the current selection alone; down: from everything) gives the result
    of a fresh state, which recomputes both thresholds exactly, bit for bit."""
    n, k = 1 << 13, 200

    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        acc = torch.randn(n, generator=g)
        state = OkTopkState(tau_prime=8)
        oktopk_allreduce(acc, k, comm, state)
        drifted = acc * scale + 0.5 * torch.randn(n, generator=g)
        guarded = oktopk_allreduce(drifted, k, comm, state)
        fresh = oktopk_allreduce(drifted, k, comm, OkTopkState(tau_prime=8))
        return guarded.stream, fresh.stream, guarded.local_indices, fresh.local_indices

    for guarded, fresh, gl, fl in run_ranks(3, fn):
        assert guarded.equal(fresh)
        assert torch.equal(gl, fl)


def test_exact_again_from_the_selection_matches_the_whole() -> None:
    from sparcml.collectives.oktopk import _exact_again
    from sparcml.compress.selection import select_above

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=g)
    x[[3, 70]] = float("nan")
    x[[9]] = float("-inf")
    x[100:140] = 2.5  # ties at the threshold
    for k in (30, 60, 800):
        for t_old in (0.5, 2.5, 3.5):
            idx = select_above(x, t_old, strict=False)
            t, got = _exact_again(x, idx, k)
            ref_t = float(torch.topk(torch.nan_to_num(x.abs(), nan=float("inf")), k).values.min())
            assert t == ref_t
            assert torch.equal(got, select_above(x, ref_t, strict=ref_t == 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_global_kth_is_exact_and_counts_every_rank(dtype: torch.dtype) -> None:
    """The radix select's threshold is the exact k-th largest |v| over all ranks, and
    the counts its last round gathers are each rank's |v| >= t (NaN as +inf, ties)."""
    from sparcml.collectives.oktopk import _global_kth
    from sparcml.compress.selection import select_above

    def fn(comm, k):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        v = torch.randn(300 + 50 * comm.rank, generator=g).to(dtype)
        v[:20] = 1.5  # ties across ranks
        if comm.rank == 1:
            v[30] = float("nan")
            v[31] = float("-inf")
        t, counts = _global_kth(v, k, comm)
        return v, t, counts, int(select_above(v, t, strict=t == 0).numel())

    for k in (1, 3, 25, 200):
        out = run_ranks(3, fn, k)
        allv = torch.cat([o[0].float() for o in out])
        mag = torch.nan_to_num(allv.abs(), nan=float("inf"))
        ref = float(torch.topk(mag, k).values.min())
        for _, t, counts, _ in out:
            assert t == ref
            assert counts == [o[3] for o in out]
    few = run_ranks(2, fn, 10_000)  # fewer than k in all
    assert all(t == 0.0 and counts is None for _, t, counts, _ in few)


def test_region_boundaries_of_2_25_selected_entries_stay_in_range() -> None:
    """The boundary samples' positions came from a float32 linspace, which rounds
    past ``n - 1`` from ``n = 2^25`` selected entries on (an IndexError at k of about
    33M); integer positions now, the samples evenly spread."""
    from sparcml.collectives.oktopk import _balanced_boundaries

    n = 2**25 + 4
    selected = torch.arange(n, dtype=torch.int64)
    (bounds,) = run_ranks(1, lambda c: _balanced_boundaries(selected, n + 10, c, 16))
    assert bounds[0] == 0 and bounds[-1] == n + 10


def test_an_empty_vector_reduces_to_an_empty_result() -> None:
    """N = 0 with k = 1 (the check allows k up to max(N, 1)) raised a RuntimeError from
    the k-th magnitude; it is an empty result on every rank, as for the other
    algorithms."""

    def fn(comm):  # type: ignore[no-untyped-def]
        state = OkTopkState()
        out = oktopk_allreduce(torch.zeros(0), 1, comm, state)
        return out.stream.size, out.stream.nnz, out.local_indices.numel(), state.calls

    assert run_ranks(3, fn) == [(0, 0, 0, 1)] * 3


def test_ranks_whose_states_differ_are_refused_naming_the_cause() -> None:
    """tau, tau_prime, quantiles, two_level and the call count decide Ok-Topk's
    messages; they were not compared, so a rank with another state (resumed on some
    ranks only, other settings) failed on the others' messages with a wire-format
    error naming nothing. Now refused alike on every rank."""
    from sparcml.errors import RankMismatchError

    def fn(comm, **mine):  # type: ignore[no-untyped-def]
        state = OkTopkState(**(mine if comm.rank == 0 else {}))
        x = torch.randn(400, generator=torch.Generator().manual_seed(comm.rank))
        try:
            oktopk_allreduce(x, 20, comm, state)
        except RankMismatchError as e:
            return str(e)
        return None

    for mine in ({"tau_prime": 1}, {"tau": 1}, {"calls": 3}):
        msgs = run_ranks(3, lambda c, m=mine: fn(c, **m))
        assert all(m is not None and "Ok-Topk, their states differ" in m for m in msgs), mine
