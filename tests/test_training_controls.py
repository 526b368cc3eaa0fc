"""Training controls (issue #17): sparse gradients, density schedules, per-layer rules,
float32 residuals, the overlapping DistributedOptimizer, per-group statistics.

In-process ranks (float64 gradients where a reference sum is compared: 1e-12) and
one spawned gloo pair for the DDP hook's sparse-gradient path against plain DDP
(1e-6: the summation order differs).
"""

from __future__ import annotations

import logging

import pytest
import torch

import sparcml.torch as st
import train_workers
from sparcml.comm import SelfCommunicator, run_ranks
from sparcml.comm.launch import run_processes
from sparcml.torch import DensityWarmup, LayerRule, SparcmlState
from sparcml.torch.reduce import Bucket, reduce_bucket


def _grad(rank: int, step: int, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _topk_dense(x: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    idx = x.abs().topk(k).indices
    out[idx] = x[idx]
    return out


# ----------------------------------------------------------------- sparse gradients
class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = torch.nn.EmbeddingBag(200, 6, mode="sum", sparse=True)
        self.out = torch.nn.Linear(6, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def _bag_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 200, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)


def test_sparse_gradients_in_process_match_the_dense_average() -> None:
    world = 3

    def fn(comm, method, hyper):  # type: ignore[no-untyped-def]
        model = _Bag().double()
        state = SparcmlState(method, comm=comm, **hyper)
        ids, y = _bag_batch(comm.rank, 0)
        torch.nn.functional.cross_entropy(model(ids), y).backward()
        mine = {n: p.grad.to_dense().clone() for n, p in model.named_parameters()}
        st.sync_gradients(model, state)
        got = {n: p.grad for n, p in model.named_parameters()}
        return mine, got, state.group_stats()["default"].bytes_sent

    for method, hyper in [("nonzeros", {}), ("topk", {"density": 1.0}), ("dense", {})]:
        out = run_ranks(world, fn, method, hyper)
        for name in out[0][0]:
            ref = sum(o[0][name] for o in out) / world
            for _, got, _ in out:
                g = got[name]
                assert g.is_sparse == (name == "emb.weight")
                assert torch.allclose(g.to_dense(), ref, rtol=0, atol=1e-12), (method, name)
                assert torch.equal(g.to_dense(), out[0][1][name].to_dense())
        if method == "nonzeros":
            # the embedding travels as its touched rows: far below its 1200 entries
            assert 0 < out[0][2] < 2 * 1200 * 8


def test_topk_of_a_sparse_gradient_below_k_is_reduced_as_it_is(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``topk`` of a sparse gradient with fewer stored entries than ``k``, once its
    residual is known to be zero, sends it as it is, through the exact sparse path
    (no dense bucket): the step's average is the exact one, like ``nonzeros``'s, the
    residual stays zero, and only the first step (no residual yet) densifies. A
    gradient with ``k`` entries or more goes the dense way again."""
    import sparcml.torch.reduce as red

    world, steps = 3, 4
    densified: list[int] = []
    dense_way = red.reduce_group

    def counted(group, bucket, *a, **kw):  # type: ignore[no-untyped-def]
        if bucket.names == ("emb.weight",):
            densified.append(bucket.step)
        return dense_way(group, bucket, *a, **kw)

    monkeypatch.setattr(red, "reduce_group", counted)

    def fn(comm, method, hyper, ids_per_bag):  # type: ignore[no-untyped-def]
        model = _Bag().double()
        state = SparcmlState(method, comm=comm, **hyper)
        got, mine = [], []
        for t in range(steps):
            g = torch.Generator().manual_seed(100 * comm.rank + t)
            ids = torch.randint(0, 200, (8, ids_per_bag), generator=g)
            model.zero_grad()
            torch.nn.functional.cross_entropy(
                model(ids), torch.zeros(8, dtype=torch.long)
            ).backward()
            mine.append(model.emb.weight.grad.to_dense().clone())
            st.sync_gradients(model, state)
            got.append(model.emb.weight.grad.to_dense().clone())
        residual = state.residuals.get("emb.weight")
        return mine, got, None if residual is None else float(residual.abs().max())

    # 8 bags of 2 ids: at most 16 rows of 6, 96 entries, below k = 600 of 1200
    out = run_ranks(world, fn, "topk", {"density": 0.5}, 2)
    for t in range(steps):
        ref = sum(o[0][t] for o in out) / world
        for _, got, residual in out:
            assert torch.allclose(got[t], ref, rtol=0, atol=1e-12), t
            assert torch.equal(got[t], out[0][1][t]) and residual == 0.0
    assert densified == [0] * world  # the first step only, on every rank
    densified.clear()
    # 8 bags of 40 ids: most of the 200 rows, more entries than k = 12 of 1200
    out = run_ranks(world, fn, "topk", {"density": 0.01}, 40)
    assert sorted(densified) == sorted(list(range(steps)) * world)
    densified.clear()
    # gtopk keeps k of the sum, not the exact sum: never the exact path
    out = run_ranks(world, fn, "topk", {"density": 0.5, "algorithm": "gtopk"}, 2)
    assert sorted(densified) == sorted(list(range(steps)) * world)


def _rows_grad(rank: int, step: int, rows: int, nan: bool = False) -> torch.Tensor:
    """A sparse (300, 1) gradient of ``rows`` seeded rows, float64; ``nan``: one NaN."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randperm(300, generator=g)[:rows].sort().values
    vals = torch.randn(rows, 1, generator=g, dtype=torch.float64)
    if nan:
        vals[0, 0] = float("nan")
    return torch.sparse_coo_tensor(idx[None], vals, (300, 1)).coalesce()


def _assert_same_averages(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    """Every rank's sparse float32 averages (per rank, per step) bit for bit rank 0's
    and ``want``'s, with the same stored indices."""
    for r, steps in enumerate(got):
        for t, avg in enumerate(steps):
            bits = avg.to_dense().reshape(-1).view(torch.int32)
            assert torch.equal(bits, got[0][t].to_dense().reshape(-1).view(torch.int32))
            assert torch.equal(bits, want[r][t].to_dense().reshape(-1).view(torch.int32))
            assert torch.equal(avg.indices(), want[r][t].indices()), (t, r)


@pytest.mark.parametrize("quantizer", [None, "natural", "qsgd"])
def test_a_quantized_topk_sends_a_sparse_gradient_below_k_as_it_is(monkeypatch, quantizer) -> None:  # type: ignore[no-untyped-def]
    """``topk+natural`` (a selector with a value quantizer) takes the exact sparse path
    too when the gradient is below ``k`` and the residual zero: every step's result
    and residual bit for bit those of the same run with every rank densifying (the
    same selection, quantized alike in the same collective), and the ranks agree,
    also in a step where one rank is above ``k`` and in one whose gradient stores
    zeros (0.0 and -0.0, which a top-k does not select)."""
    import sparcml.torch.reduce as red
    from sparcml.torch.reduce import reduce_sparse_gradient

    plan = [(5, 8, 6), (5, 60, 7), (4, 9, 5), (3, 3, 3)]  # rows per (step, rank); k = 30
    whole: list[tuple[int, int]] = []
    sent_whole = red._reduce_whole_selection

    def counted(group, bucket, *a):  # type: ignore[no-untyped-def]
        whole.append((bucket.step, group.comm.rank))
        return sent_whole(group, bucket, *a)

    def fn(comm):  # type: ignore[no-untyped-def]
        method = "topk" if quantizer is None else f"topk+{quantizer}"
        state = SparcmlState(method, comm=comm, density=0.1)
        outs = []
        for t, rows in enumerate(plan):
            g = _rows_grad(comm.rank, t, rows[comm.rank]).float()
            if t == 2:  # stored zeros
                vals = g.values().clone()
                vals[:2] = torch.tensor([[0.0], [-0.0]])
                g = torch.sparse_coo_tensor(g.indices(), vals, g.shape).coalesce()
            outs.append(reduce_sparse_gradient(state, Bucket(("w",), (300,), g, t)))
        return outs, state.residuals["w"].clone()

    monkeypatch.setattr(red, "_reduce_whole_selection", counted)
    out = run_ranks(3, fn)
    # ranks 0 and 2 from step 1 on; rank 1 keeps a residual from its step above k
    assert sorted(whole) == [(1, 0), (1, 2), (2, 0), (2, 2), (3, 0), (3, 2)]
    monkeypatch.setattr(red, "_selection_is_the_gradient", lambda *a: False)
    dense = run_ranks(3, fn)  # every rank densifies every step
    _assert_same_averages([o[0] for o in out], [d[0] for d in dense])
    for r in range(3):
        assert torch.equal(out[r][1], dense[r][1])
    assert float(out[0][1].abs().max()) == 0.0 and float(out[2][1].abs().max()) == 0.0


@pytest.mark.parametrize("quantizer", [None, "natural", "qsgd"])
@pytest.mark.parametrize("nan_policy", ["propagate", "raise", "unchecked"])
def test_topk_of_a_sparse_gradient_above_k_selects_from_its_entries(  # type: ignore[no-untyped-def]
    monkeypatch, quantizer, nan_policy
) -> None:
    """A sparse gradient with ``k`` entries or more, or one that meets a residual left
    by such a step, is selected from the entries of ``residual + g`` (no dense
    bucket) at ``2^16`` entries and more: every step's average and residual are those
    of the run in which every rank densifies, bit for bit (the residual as numbers: a
    zero's sign may differ), on every rank, also when one rank densifies while the
    others select from the entries, with ties at the k-th magnitude, stored zeros, a
    rank that covers its residual again, and a NaN: under ``"propagate"`` every rank
    goes dense with the residuals untouched, under ``"unchecked"`` it is selected
    and stays in the residual (``NaN - NaN``)."""
    import sparcml.torch.reduce as red
    from sparcml.compress.threshold_reuse import BRACKET_MIN
    from sparcml.torch.reduce import reduce_sparse_gradient

    n = BRACKET_MIN
    # rows per (step, rank); k = 66 (density 0.001): the first step has no residual
    # yet (dense); then rank 1 above k; rank 1 with its residual; ties (every rank
    # above k); every rank below k with a residual, ranks 0 and 2 covering theirs;
    # rank 1 covering; a NaN on ranks 1 and 2, and a step after it
    plan = [
        (20, 30, 25), (20, 200, 30), (20, 40, 30), (90, 70, 100), (5, 3, 4), (5, 3, 4),
        (80, 9, 70), (5, 3, 4),
    ]  # fmt: skip
    # (a quantizer cannot encode a NaN: under "unchecked" the collective refuses it
    # on every rank, on both paths)
    nan_step = nan_policy == "propagate" or (nan_policy == "unchecked" and quantizer is None)
    if not nan_step:
        plan = plan[:-2]
    entries: list[tuple[int, int]] = []
    from_entries = red._reduce_whole_selection

    def counted(group, bucket, g, shape, sparse_dim, residual=None, rows=None):  # type: ignore[no-untyped-def]
        if residual is not None:
            entries.append((bucket.step, group.comm.rank))
        return from_entries(group, bucket, g, shape, sparse_dim, residual, rows)

    def fn(comm):  # type: ignore[no-untyped-def]
        method = "topk" if quantizer is None else f"topk+{quantizer}"
        state = SparcmlState(method, comm=comm, density=0.001, nan_policy=nan_policy)
        outs, residuals = [], []
        for t, rows in enumerate(plan):
            gen = torch.Generator().manual_seed(1000 * comm.rank + t)
            idx = torch.randperm(n, generator=gen)[: rows[comm.rank]].sort().values
            vals = torch.randn(idx.numel(), 1, generator=gen)
            if t == 3:  # ties at every magnitude, and stored zeros
                vals = torch.randint(-2, 3, (idx.numel(), 1), generator=gen).float()
                vals[:2] = torch.tensor([[0.0], [-0.0]])
            if t == 6 and comm.rank in (1, 2):
                vals[3, 0] = float("nan")
            g = torch.sparse_coo_tensor(idx[None], vals, (n, 1)).coalesce()
            outs.append(reduce_sparse_gradient(state, Bucket(("w",), (n,), g, t)))
            residuals.append(state.residuals["w"].clone())
        return outs, residuals

    monkeypatch.setattr(red, "_reduce_whole_selection", counted)
    out = run_ranks(3, fn)
    # rank 1 from step 1 on (above k, then its residual) until it covers it in step
    # 5; ranks 0 and 2 above k in step 3, covering their residuals in step 4, above
    # k again in step 6
    want = [(1, 1), (2, 1), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2), (5, 1)]
    if nan_policy == "propagate":
        want += [(6, 0), (6, 2)]  # (rank 1, below k, sends its entries as they are)
    elif nan_step:
        # rank 1's NaN leaves NaN - NaN in its residual: no zero mark for step 7
        want += [(6, 0), (6, 1), (6, 2), (7, 0), (7, 1), (7, 2)]
    assert sorted(entries) == want
    entries.clear()
    # rank 0 densifies every step, the others as before: the same collectives
    sparse_way, entries_way = red._selection_is_the_gradient, red._residual_for_entries
    monkeypatch.setattr(
        red, "_selection_is_the_gradient",
        lambda group, *a: group.comm.rank != 0 and sparse_way(group, *a),
    )  # fmt: skip
    monkeypatch.setattr(
        red, "_residual_for_entries",
        lambda group, *a: None if group.comm.rank == 0 else entries_way(group, *a),
    )  # fmt: skip
    mixed = run_ranks(3, fn)
    assert sorted(entries) == [e for e in want if e[1] != 0]
    monkeypatch.setattr(red, "_selection_is_the_gradient", lambda *a: False)
    monkeypatch.setattr(red, "_residual_for_entries", lambda *a: None)
    entries.clear()
    dense = run_ranks(3, fn)  # every rank densifies every step
    assert entries == []
    for run in (out, mixed):
        _assert_same_averages([o[0] for o in run], [d[0] for d in dense])
        for t in range(len(plan)):
            for r in range(3):
                torch.testing.assert_close(
                    run[r][1][t], dense[r][1][t], rtol=0, atol=0, equal_nan=True
                )
    assert float(out[1][1][4].abs().max()) > 0  # a residual was kept
    assert float(out[1][1][5].abs().max()) == 0  # and covered again
    assert float(out[0][1][4].abs().max()) == 0
    if nan_step:
        assert bool(out[0][0][6].to_dense().isnan().any())
    if nan_policy == "propagate":
        for r in range(3):
            assert torch.equal(out[r][1][6], out[r][1][5])  # residuals untouched
    if nan_step and nan_policy == "unchecked":
        assert bool(out[2][1][6].isnan().any())  # NaN - NaN, as the dense path keeps


def test_topk_densifies_where_the_entries_fill_the_bucket(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the residual's non-zeros and the gradient's entries hold more than
    ``ENTRIES_MAX`` of the bucket, densifying is faster than selecting from the
    entries: such a step densifies (the same bits either way), a sparser one after
    it selects from the entries again."""
    import sparcml.torch.reduce as red
    from sparcml.compress.threshold_reuse import BRACKET_MIN
    from sparcml.torch.reduce import reduce_sparse_gradient

    n = BRACKET_MIN  # k = 6,554 (density 0.1); ENTRIES_MAX of the bucket: 8,192 entries
    # rows per step: a residual of about 450 left; 12,000 rows (more than 8,192 alone:
    # dense, a residual of about 5,800 left); 3,000 rows (the residual's count, about
    # 5,800, over the 5,192 left: dense, about 2,000 left); 300 rows (about 2,300
    # entries: from the entries, covering); 300 rows with a zero residual (as they are)
    plan = [7000, 12000, 3000, 300, 300]
    entries: list[int] = []
    from_entries = red._reduce_whole_selection

    def counted(group, bucket, g, shape, sparse_dim, residual=None, rows=None):  # type: ignore[no-untyped-def]
        if residual is not None:
            entries.append(bucket.step)
        return from_entries(group, bucket, g, shape, sparse_dim, residual, rows)

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", comm=comm, density=0.1)
        outs = []
        for t, rows in enumerate(plan):
            gen = torch.Generator().manual_seed(10 * comm.rank + t)
            idx = torch.randperm(n, generator=gen)[:rows].sort().values
            g = torch.sparse_coo_tensor(idx[None], torch.randn(rows, 1, generator=gen), (n, 1))
            outs.append(reduce_sparse_gradient(state, Bucket(("w",), (n,), g.coalesce(), t)))
        return outs, state.residuals["w"].clone()

    monkeypatch.setattr(red, "_reduce_whole_selection", counted)
    out = run_ranks(2, fn)
    assert entries == [3, 3]
    monkeypatch.setattr(red, "ENTRIES_MAX", 1.0)
    entries.clear()
    everywhere = run_ranks(2, fn)  # steps 1 and 2 from the entries too
    assert sorted(entries) == [1, 1, 2, 2, 3, 3]
    _assert_same_averages([o[0] for o in out], [e[0] for e in everywhere])
    for r in range(2):
        torch.testing.assert_close(out[r][1], everywhere[r][1], rtol=0, atol=0)


def test_ranks_that_straddle_k_take_both_sparse_paths_and_agree(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """In one step a rank whose sparse gradient is below ``k`` sends it as it is, while
    another densifies and selects (``k`` or more entries, or a residual left): the
    same collectives on both paths, results bit for bit the same on every rank and
    Alg. 1's sum; a NaN on a rank that sends as it is takes every rank dense
    (``nan_policy="propagate"``), the residuals untouched."""
    import sparcml.torch.reduce as red
    from sparcml.torch.reduce import reduce_sparse_gradient

    k = 30  # density 0.1 of 300
    # rows per (step, rank): below k everywhere; rank 1 above; rank 1 below with a
    # residual left; rank 2 below with a NaN; below everywhere
    plan = [(5, 8, 6), (5, 60, 7), (4, 9, 5), (6, 5, 4), (3, 3, 3)]
    nan_at = (3, 2)
    whole: list[tuple[int, int]] = []
    sent_whole = red._reduce_whole_selection

    def counted(group, bucket, *a):  # type: ignore[no-untyped-def]
        whole.append((bucket.step, group.comm.rank))
        return sent_whole(group, bucket, *a)

    monkeypatch.setattr(red, "_reduce_whole_selection", counted)

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", comm=comm, density=0.1)
        outs = []
        for t, rows in enumerate(plan):
            g = _rows_grad(comm.rank, t, rows[comm.rank], (t, comm.rank) == nan_at)
            outs.append(reduce_sparse_gradient(state, Bucket(("w",), (300,), g, t)))
        return outs, state.residuals["w"].clone()

    out = run_ranks(3, fn)
    for t in range(len(plan)):
        dense = [o[0][t].to_dense().reshape(-1) for o in out]
        for r in range(3):
            assert torch.equal(out[r][0][t].indices(), out[0][0][t].indices()), (t, r)
            assert torch.equal(dense[r].view(torch.int64), dense[0].view(torch.int64)), (t, r)
    # Alg. 1 in one process (the NaN step: dense everywhere, residuals kept)
    eps = [torch.zeros(300, dtype=torch.float64) for _ in range(3)]
    for t, rows in enumerate(plan):
        grads = [
            _rows_grad(r, t, rows[r], (t, r) == nan_at).to_dense().reshape(-1) for r in range(3)
        ]
        got = out[0][0][t].to_dense().reshape(-1)
        if t == nan_at[0]:
            ref = sum(grads) / 3
            assert torch.equal(torch.isnan(got), torch.isnan(ref))
            assert torch.allclose(got[~torch.isnan(ref)], ref[~torch.isnan(ref)], atol=1e-12)
            continue
        total = torch.zeros(300, dtype=torch.float64)
        for r in range(3):
            acc = eps[r] + grads[r]
            sel = _topk_dense(acc, k)
            eps[r] = acc - sel
            total += sel
        assert torch.allclose(got, total / 3, rtol=0, atol=1e-12), t
    for r in range(3):
        assert torch.allclose(out[r][1], eps[r], atol=1e-12)
    # who sent as it is: every rank below k whose residual was zero, from step 1 on
    assert sorted(whole) == [(1, 0), (1, 2), (2, 0), (2, 2), (3, 0), (3, 2), (4, 0), (4, 2)]


def test_sparse_gradient_method_refused_up_front() -> None:
    model = _Bag()
    state = SparcmlState("natural", comm=SelfCommunicator())
    with pytest.raises(ValueError, match=r"'emb.weight' has a sparse gradient.*nonzeros"):
        st.sync_gradients(model, state)
    # routed by a layer rule, it trains
    state = SparcmlState("natural", comm=SelfCommunicator(), layers=[("emb.*", "nonzeros")])
    ids, y = _bag_batch(0, 0)
    torch.nn.functional.cross_entropy(model(ids), y).backward()
    st.sync_gradients(model, state)
    assert model.emb.weight.grad.is_sparse


@pytest.mark.spawn
def test_ddp_sparse_embedding_of_width_one_nonzeros_equals_plain_ddp() -> None:
    """A linear model's EmbeddingBag(F, 1, sparse=True): a gradient with a trailing
    dimension of size 1 (its rows back into COO failed once)."""
    configs = [(None, {}), ("nonzeros", {}), ("dense", {}), ("topk", {"density": 0.1})]
    out = run_processes(2, train_workers.ddp_sparse_embedding, configs, 8, 1, timeout=120)
    for r in range(2):
        plain, nonzeros, dense, topk = out[r]
        for res in (nonzeros, dense):
            assert res["sparse_grad"]
            assert torch.allclose(res["params"], plain["params"], rtol=0, atol=1e-6)
        assert topk["losses"][-1] < topk["losses"][0]
        for j in (1, 2, 3):
            assert torch.equal(out[r][j]["params"], out[0][j]["params"])


@pytest.mark.spawn
def test_ddp_sparse_embedding_nonzeros_equals_plain_ddp_and_topk_trains() -> None:
    configs = [
        (None, {}), ("nonzeros", {}), ("topk", {"density": 1.0}), ("topk", {"density": 0.1}),
        ("natural", {}),  # refused at register(), on every rank
    ]  # fmt: skip
    out = run_processes(2, train_workers.ddp_sparse_embedding, configs, 4, timeout=120)
    for r in range(2):
        plain, nonzeros, lossless_topk, topk, refused = out[r]
        assert "'0.weight' has a sparse gradient" in refused["error"]
        assert torch.allclose(nonzeros["params"], plain["params"], rtol=0, atol=1e-6)
        assert torch.allclose(lossless_topk["params"], plain["params"], rtol=0, atol=1e-6)
        assert nonzeros["sparse_grad"] and topk["sparse_grad"]
        assert topk["losses"][-1] < topk["losses"][0]
        for j in (1, 2, 3):  # bitwise identical on every rank
            assert torch.equal(out[r][j]["params"], out[0][j]["params"])


# ----------------------------------------------------------------- schedules
def test_density_warmup_and_assignment_change_the_bytes() -> None:
    n = 4000

    def fn(comm):  # type: ignore[no-untyped-def]
        warm = DensityWarmup(steps_per_epoch=2, epochs=2, start=0.2, end=0.01)
        state = SparcmlState("topk", warm, comm=comm)
        for t in range(6):
            reduce_bucket(state, Bucket(("w",), (n,), _grad(comm.rank, t, n), t))
        state.density = 0.05  # takes effect at the next step
        reduce_bucket(state, Bucket(("w",), (n,), _grad(comm.rank, 6, n), 6))
        return list(state.step_bytes), state.stats.last_selected

    step_bytes, selected = run_ranks(2, fn)[0]
    # densities 0.2, 0.2, 0.0447, 0.0447, 0.01, 0.01, then 0.05: k = 800, 179, 40, 200
    assert step_bytes[0] == step_bytes[1] > step_bytes[2] == step_bytes[3] > step_bytes[4]
    assert step_bytes[4] == step_bytes[5] < step_bytes[2] < step_bytes[6] < step_bytes[0]
    assert selected == 200
    with pytest.raises(ValueError, match="density must be in"):
        SparcmlState("topk", comm=SelfCommunicator()).density = 1.5


def test_method_schedule_by_rule() -> None:
    """A rule that holds on some steps only: dense for the first two steps."""
    n = 500

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState(
            "topk", 0.02, comm=comm, layers=[LayerRule("dense", when=lambda s: s < 2)]
        )
        outs = [
            reduce_bucket(state, Bucket(("w",), (n,), _grad(comm.rank, t, n), t)) for t in range(3)
        ]
        return outs, state.group_stats()

    out = run_ranks(2, fn)
    for t in range(2):
        ref = (_grad(0, t, n) + _grad(1, t, n)) / 2
        assert torch.allclose(out[0][0][t], ref, rtol=0, atol=1e-12)
    assert int((out[0][0][2] != 0).sum()) <= 2 * 10  # top-k at step 2
    stats = out[0][1]
    assert stats["default"].steps == 1 and stats["* when ... -> dense"].steps == 2


# ----------------------------------------------------------------- per-layer rules
@pytest.mark.parametrize("world", [1, 3])
def test_layer_rules_route_each_parameter(world: int) -> None:
    names = ("a.weight", "a.bias", "b.weight", "b.bias", "emb.weight")
    sizes = (600, 30, 400, 20, 900)
    n = sum(sizes)
    rules = [
        ("*.bias", "dense"),
        LayerRule("topk", pattern="b.*", density=0.1),
        ("emb.*", "nonzeros"),
    ]

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", 0.02, comm=comm, layers=rules)
        g = _grad(comm.rank, 0, n)
        g[sum(sizes[:4]) :][::3] = 0.0  # a naturally sparse part for nonzeros
        out = reduce_bucket(state, Bucket(names, sizes, g, 0))
        return g, out, {k: v.bytes_sent for k, v in state.group_stats().items()}, state

    out = run_ranks(world, fn)
    grads = [o[0] for o in out]
    parts = [dict(zip(names, g.split(sizes), strict=True)) for g in grads]
    got = dict(zip(names, out[0][1].split(sizes), strict=True))
    # biases and the embedding: exact averages; a.weight: top-2%; b.weight: top-10%
    for name in ("a.bias", "b.bias", "emb.weight"):
        ref = sum(p[name] for p in parts) / world
        assert torch.allclose(got[name], ref, rtol=0, atol=1e-12), name
    for name, k in (("a.weight", 12), ("b.weight", 40)):
        ref = sum(_topk_dense(p[name], k) for p in parts) / world
        assert torch.allclose(got[name], ref, rtol=0, atol=1e-12), name
    for o in out:
        assert torch.equal(o[1], out[0][1])
    groups = out[0][2]
    assert set(groups) == {"default", "*.bias -> dense", "b.* -> topk", "emb.* -> nonzeros"}
    if world > 1:  # bytes by group: each group sends, dense biases as many as a
        # dense allreduce of their 50 float64 entries
        ones = torch.ones(50, dtype=torch.float64)

        def plain(c):  # type: ignore[no-untyped-def]
            reduce_bucket(SparcmlState("dense", comm=c), Bucket(("b",), (50,), ones, 0))
            return c.stats.bytes_sent

        dense = run_ranks(world, plain)
        assert groups["*.bias -> dense"] == dense[0]
        assert all(b > 0 for b in groups.values())
        assert sum(groups.values()) == out[0][3].bytes_sent


def test_dense_below_and_bad_rules() -> None:
    state = SparcmlState("topk", comm=SelfCommunicator(), dense_below=100)
    assert state.group_of("x", 99, 0).method == "dense"
    assert state.group_of("x", 100, 0) is state.groups[0]
    with pytest.raises(ValueError, match=r"layer rule '\*.bias -> nope'.*unknown method"):
        SparcmlState("topk", comm=SelfCommunicator(), layers=[("*.bias", "nope")])
    with pytest.raises(TypeError, match="layers\\[0\\] must be a LayerRule"):
        SparcmlState("topk", comm=SelfCommunicator(), layers=["*.bias"])  # type: ignore[list-item]


# ----------------------------------------------------------------- residual precision
def test_float32_residuals_keep_the_feedback_invariant_for_bfloat16() -> None:
    n = 3000
    state = SparcmlState("topk", 0.01, comm=SelfCommunicator())
    residual = torch.zeros(n, dtype=torch.float32)
    for t in range(4):
        g = _grad(0, t, n, torch.bfloat16) * 1e-3
        acc = residual + g.float()
        avg = reduce_bucket(state, Bucket(("w",), (n,), g, t))
        assert avg.dtype == torch.bfloat16  # what is sent and returned stays 16-bit
        residual = state.residuals["w"]
        assert residual.dtype == torch.float32
        assert torch.equal(residual + avg.float(), acc)  # exact: sent + residual == acc
    lean = SparcmlState("topk", 0.01, comm=SelfCommunicator(), residual_precision="gradient")
    reduce_bucket(lean, Bucket(("w",), (n,), _grad(0, 0, n, torch.bfloat16), 0))
    assert lean.residuals["w"].dtype == torch.bfloat16


# ----------------------------------------------------------------- overlapping optimizer
def _seeded(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)  # (in-process ranks share torch's global RNG)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model


def _deep_model() -> torch.nn.Module:
    return _seeded(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    ).double())  # fmt: skip


@pytest.mark.parametrize("method", ["topk", "topk+natural"])
def test_overlapping_optimizer_equals_sync_gradients_bitwise(method: str) -> None:
    def fn(comm, overlap: bool, passes: int):  # type: ignore[no-untyped-def]
        model = _deep_model()
        state = SparcmlState(method, 0.05, comm=comm, bucket_bytes=8 * 2000)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = st.DistributedOptimizer(
            base, model, state, overlap=overlap, backward_passes_per_step=passes
        )
        started = []
        for t in range(3):
            for micro in range(passes):
                g = torch.Generator().manual_seed(10 * comm.rank + 3 * t + micro)
                x = torch.randn(16, 32, generator=g, dtype=torch.float64)
                model(x).square().mean().backward()
            started.append(opt._next == len(opt._items) > 1 if overlap else True)
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), started

    for passes in (1, 2):
        ref = run_ranks(2, fn, False, passes)
        got = run_ranks(2, fn, True, passes)
        for r in range(2):
            assert torch.equal(got[r][0], ref[r][0])
            assert torch.equal(got[r][0], got[0][0])
            # every bucket (several) was handed to the engine during backward
            assert got[r][1] == [True, True, True]


def test_overlapping_optimizer_refuses_an_extra_backward_and_a_zero_grad_before_step() -> None:
    """An audit found DistributedOptimizer (overlap=True) silently wrong when a
    backward was not followed by step(): a second backward (backward_passes_per_step
    = 1) was lost, and zero_grad() between backward and step() left the dropped
    batch's reduction to be applied at the next step. Both now raise, on every rank
    alike, naming the fix; synchronize() first makes zero_grad() legal, and the
    reductions stay in step with sync_gradients'."""

    def fn(comm, overlap: bool):  # type: ignore[no-untyped-def]
        model = _deep_model()
        state = SparcmlState("topk", 0.05, comm=comm, bucket_bytes=8 * 2000)
        opt = st.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, state,
                                      overlap=overlap)  # fmt: skip

        def backward(t: int) -> None:
            g = torch.Generator().manual_seed(10 * comm.rank + t)
            model(torch.randn(16, 32, generator=g, dtype=torch.float64)).square().mean().backward()

        errors = []
        backward(0)
        try:
            opt.zero_grad()  # dropping batch 0
        except RuntimeError as e:
            errors.append(str(e))
            opt.synchronize()  # finish its reductions, then drop their result
            opt.zero_grad()
        backward(1)
        try:
            backward(2)  # a second pass, one declared
        except RuntimeError as e:
            errors.append(str(e))
            opt.synchronize()
            opt.zero_grad()
            backward(3)
        opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), errors

    got = run_ranks(2, fn, True)
    for params, errors in got:
        assert len(errors) == 2 and "zero_grad() after a backward and before step()" in errors[0]
        assert "computed 2 times before step(), with backward_passes_per_step=1" in errors[1]
        assert torch.equal(params, got[0][0])
    # overlap=False reduces in step() only: dropping a batch needs no synchronize
    ref = run_ranks(2, fn, False)
    assert ref[0][1] == [] and not torch.equal(ref[0][0], got[0][0])


def test_broadcast_optimizer_state() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        model = _deep_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 + comm.rank, momentum=0.9)
        if comm.rank == 0:
            model(torch.ones(2, 32, dtype=torch.float64)).sum().backward()
            opt.step()
        state = SparcmlState("dense", comm=comm)
        st.broadcast_optimizer_state(opt, state)
        sd = opt.state_dict()
        return sd["param_groups"][0]["lr"], [sd["state"][i]["momentum_buffer"] for i in range(6)]

    out = run_ranks(3, fn)
    for lr, bufs in out:
        assert lr == out[0][0] == 0.1
        assert all(torch.equal(a, b) for a, b in zip(bufs, out[0][1], strict=True))


# ----------------------------------------------------------------- statistics
def test_group_stats_and_logging(caplog: pytest.LogCaptureFixture) -> None:
    n = 2000

    def fn(comm):  # type: ignore[no-untyped-def]
        model = _seeded(torch.nn.Linear(n // 10, 10).double())
        state = SparcmlState("topk", 0.01, comm=comm, layers=[("*.bias", "dense")], stats_every=2)
        for t in range(2):
            model(_grad(comm.rank, t, n // 10).reshape(1, -1)).sum().backward()
            st.sync_gradients(model, state)
            model.zero_grad()
        return {k: v.as_dict() for k, v in state.group_stats().items()}

    with caplog.at_level(logging.INFO, logger="sparcml.stats"):
        out = run_ranks(2, fn)
    default = out[0]["default"]
    assert default["steps"] == 2 and default["last_selected"] == default["last_k"] == 20
    assert default["ratio"] > 5  # top-1% pairs vs a dense ring allreduce
    assert default["compress_s"] > 0 and default["communicate_s"] > 0
    assert default["residual_norm"] > 0 and out[0]["*.bias -> dense"]["residual_norm"] == 0
    assert out[0]["*.bias -> dense"]["ratio"] == pytest.approx(1.0)
    lines = [r.getMessage() for r in caplog.records if "sparcml step 1" in r.getMessage()]
    assert any("[default: topk, 2000 entries]" in m and "selected 20/20" in m for m in lines)


def test_a_lossless_rule_under_momentum_correction_sends_only_the_nonzeros() -> None:
    """Issue 33: with the state's DGC momentum (momentum=0.9) a layer rule to
    'nonzeros' sent the dense momentum u = m u + g (13x the bytes). A lossless sum
    needs no correction: the momentum is applied after the exact average, the same
    update as momentum SGD, and only the gradient's non-zeros travel."""
    import sparcml.torch as st
    from sparcml.comm import run_ranks

    steps, m = 3, 0.9

    def fn(comm, momentum):  # type: ignore[no-untyped-def]
        emb = torch.nn.Embedding(400, 8)  # dense gradient, a few rows non-zero
        with torch.no_grad():  # the same weights on every rank (threads share torch's RNG)
            emb.weight.copy_(torch.randn(400, 8, generator=torch.Generator().manual_seed(0)))
        state = st.SparcmlState("topk", density=0.1, momentum=momentum, comm=comm,
                                layers=[("weight", "nonzeros")])  # fmt: skip
        grads = []
        for t in range(steps):
            emb.zero_grad()
            rows = torch.tensor([3 * comm.rank + t, 50 + t])
            emb(rows).sum().backward()
            st.sync_gradients(emb, state)
            grads.append(emb.weight.grad.clone())
        sent = state.group_stats()
        return grads, {k: g.bytes_sent for k, g in sent.items()}

    with_m = run_ranks(3, fn, m)
    without = run_ranks(3, fn, 0.0)
    for r in range(3):
        assert with_m[r][1] == without[r][1]  # the same bytes: non-zeros only
        u = torch.zeros(400, 8)
        for t in range(steps):  # momentum SGD on the exact averages
            u = m * u + without[r][0][t]
            assert torch.allclose(with_m[r][0][t], u, rtol=0, atol=1e-6)
            assert torch.equal(with_m[r][0][t], with_m[0][0][t])  # every rank alike
