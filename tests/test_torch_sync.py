"""sparcml.torch: every method's synchronised gradient against a one-process reference.

In-process ranks; each rank's gradients are fixed tensors (seeded). References
compute the method from its definition over all ranks' gradients in one process
(float64 data: sums agree to 1e-12; selections are compared exactly). Stochastic
quantizers have no exact reference: they are checked for bitwise identity across
ranks, unbiasedness (mean over 200 seeds within 5 standard errors of the dense
mean) and their per-entry error bound (one quantizer step per quantization).
"""

from __future__ import annotations

import math

import pytest
import torch

import sparcml.torch as st
from sparcml.comm import run_ranks
from sparcml.compress import get
from sparcml.compress.threshold_reuse import BRACKET_MIN
from sparcml.errors import RankMismatchError
from sparcml.torch import SparcmlState
from sparcml.torch.reduce import Bucket, reduce_bucket

SIZES = (300, 7, 1200, 40)  # parameters of one bucket (a bias-like 7 and 40)
WORLDS = [1, 2, 3, 4, 5, 8]
STEPS = 3


def _grads(rank: int, step: int, n: int = sum(SIZES)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, generator=g, dtype=torch.float64)


def _names() -> tuple[str, ...]:
    return tuple(f"p{i}" for i in range(len(SIZES)))


def _run(world: int, method: str, steps: int = STEPS, **hyper):  # type: ignore[no-untyped-def]
    """Each rank reduces its gradient of every step; returns the outputs per rank."""

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState(method, comm=comm, **hyper)
        outs = []
        for t in range(steps):
            outs.append(reduce_bucket(state, Bucket(_names(), SIZES, _grads(comm.rank, t), t)))
        return outs, state

    return run_ranks(world, fn)


def _k(density: float, n: int) -> int:
    """Entries a selector keeps: round(density * n), at least 1 (sparcml.compress)."""
    return min(n, max(1, round(density * n)))


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    idx = x.abs().topk(k).indices
    out[idx] = x[idx]
    return out


def _assert_identical(out) -> None:  # type: ignore[no-untyped-def]
    for outs, _ in out:
        for a, b in zip(outs, out[0][0], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", WORLDS)
def test_dense_is_the_mean(world: int) -> None:
    out = _run(world, "dense")
    _assert_identical(out)
    for t in range(STEPS):
        ref = sum(_grads(r, t) for r in range(world)) / world
        assert torch.allclose(out[0][0][t], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algorithm", ["auto", "ssar_recursive_double", "dsar_split_allgather"])
def test_topk_with_error_feedback_equals_alg1(world: int, algorithm: str) -> None:
    """SparCML Alg. 1: acc = eps + g; eps = acc - TopK(acc); g = sum TopK(acc) / P."""
    density = 0.05
    out = _run(world, "topk", density=density, algorithm=algorithm)
    _assert_identical(out)
    k = _k(density, sum(SIZES))
    eps = [torch.zeros(sum(SIZES), dtype=torch.float64) for _ in range(world)]
    for t in range(STEPS):
        total = torch.zeros(sum(SIZES), dtype=torch.float64)
        for r in range(world):
            acc = eps[r] + _grads(r, t)
            sel = _topk(acc, k)
            eps[r] = acc - sel
            total += sel
        assert torch.allclose(out[0][0][t], total / world, rtol=0, atol=1e-12)
    # the residuals are kept per parameter name
    for r, (_, state) in enumerate(out):
        kept = torch.cat([state.residuals[n] for n in _names()])
        assert torch.allclose(kept, eps[r], atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_quantized_topk_with_topka_equals_sum_of_quantized_selections(world: int) -> None:
    """topk+natural (deterministic rounding) through TopkA: every selection's values
    are quantized once, then summed; the residual keeps acc - TopK(acc) (Alg. 1)."""
    density = 0.05
    out = _run(
        world,
        "topk+natural",
        density=density,
        algorithm="topka",
        compressor_params={"deterministic": True},
    )
    _assert_identical(out)
    q = get("natural", deterministic=True)
    k = _k(density, sum(SIZES))
    eps = [torch.zeros(sum(SIZES), dtype=torch.float64) for _ in range(world)]
    for t in range(STEPS):
        total = torch.zeros(sum(SIZES), dtype=torch.float64)
        for r in range(world):
            acc = eps[r] + _grads(r, t)
            sel = _topk(acc, k)
            eps[r] = acc - sel
            nz = sel != 0
            # a world of one sends nothing, so nothing is quantized
            total[nz] += q.decompress(*q.compress(sel[nz])) if world > 1 else sel[nz]
        assert torch.allclose(out[0][0][t], total / world, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_and_masking_follow_dgc(world: int, masking: bool) -> None:
    """u = m u + g; v = v + u; send TopK(v); v = 0 where sent, and u too with
    momentum factor masking (RedSync sec. 3.5; off by default)."""
    density, m = 0.05, 0.9
    out = _run(world, "topk", density=density, momentum=m, momentum_masking=masking,
               algorithm="ssar_split_allgather")  # fmt: skip
    _assert_identical(out)
    k = _k(density, sum(SIZES))
    n = sum(SIZES)
    u = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    v = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for t in range(STEPS):
        total = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            u[r] = m * u[r] + _grads(r, t)
            v[r] = v[r] + u[r]
            sel = _topk(v[r], k)
            mask = sel != 0
            v[r] = v[r] - sel
            if masking:
                u[r] = u[r].masked_fill(mask, 0.0)
            total += sel
        assert torch.allclose(out[0][0][t], total / world, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_oktopk_equals_its_definition(world: int) -> None:
    """tau = tau' = 1: keep the entries of the sum of local top-k sets whose magnitude
    reaches its k-th largest; eps = acc - acc(indexes) with the kept local indexes."""
    density = 0.05
    out = _run(world, "oktopk", density=density, tau=1, tau_prime=1)
    _assert_identical(out)
    n = sum(SIZES)
    k = _k(density, n)
    eps = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for t in range(STEPS):
        accs = [eps[r] + _grads(r, t) for r in range(world)]
        sels = [_topk(a, k) for a in accs]
        total = sum(sels)
        support = torch.stack([s != 0 for s in sels]).any(0)
        mags = total.abs()[support]
        thr = mags.topk(min(k, mags.numel())).values.min()
        keep = support & (total.abs() >= thr)
        ref = torch.where(keep, total, torch.zeros_like(total))
        assert torch.allclose(out[0][0][t], ref / world, rtol=0, atol=1e-12)
        for r in range(world):
            sent = (sels[r] != 0) & keep
            eps[r] = accs[r].masked_fill(sent, 0.0)


def _redsync_reference(
    world: int, asq: bool, min_bytes: int, feedback: str = "paper", output: str | None = None
) -> list[torch.Tensor]:
    density = 0.05
    n = sum(SIZES)
    eps = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    outs = []
    for t in range(STEPS):
        total = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            acc = eps[r] + _grads(r, t)
            sent = torch.zeros(n, dtype=torch.float64)
            fed_back = acc.clone()  # the new residual
            lo = 0
            for name, size in zip(_names(), SIZES, strict=True):
                layer = acc[lo : lo + size]
                k = _k(density, size)
                if size * 8 < min_bytes:
                    sent[lo : lo + size] = layer  # small layers go uncompressed
                    fed_back[lo : lo + size] = 0
                elif asq and name != output:
                    # alternate: top-k positive entries on even calls, negative on odd
                    signed = layer if t % 2 == 0 else -layer
                    k = min(k, int((signed > 0).sum()))
                    idx = signed.topk(k).indices
                    mean = layer[idx].mean().float().double()  # one float32 mean
                    sent[lo + idx] = mean
                    # RedSync Alg. 1: the entries outside the set are the new residual
                    fed_back[lo + idx] = 0 if feedback == "paper" else layer[idx] - mean
                else:  # (the output layer is sparsified, never quantized)
                    idx = layer.abs().topk(k).indices  # trimmed top-k selects exactly k
                    sent[lo + idx] = layer[idx]
                    fed_back[lo + idx] = 0
                lo += size
            eps[r] = fed_back
            total += sent
        outs.append(total / world)
    return outs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("asq", [False, True])
def test_redsync_equals_per_layer_selection_and_packed_allgather(world: int, asq: bool) -> None:
    min_bytes = 100 * 8  # layers of 7 and 40 entries go dense
    out = _run(world, "redsync", density=0.05, asq=asq, min_bytes=min_bytes)
    _assert_identical(out)
    for got, ref in zip(out[0][0], _redsync_reference(world, asq, min_bytes), strict=True):
        assert torch.allclose(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("feedback", ["paper", "quantization_error"])
def test_redsync_asq_residual_and_unquantized_output_layer(world: int, feedback: str) -> None:
    min_bytes = 100 * 8
    out = _run(
        world, "redsync", density=0.05, asq=True, min_bytes=min_bytes,
        asq_feedback=feedback, output_layer="p2",
    )  # fmt: skip
    _assert_identical(out)
    ref = _redsync_reference(world, True, min_bytes, feedback, output="p2")
    for got, want in zip(out[0][0], ref, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_redsync_sends_one_message_per_rank_and_bsearch_for_large_layers() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("redsync", density=0.01, comm=comm, min_bytes=0, bsearch_numel=1000)
        comm.stats.reset()
        reduce_bucket(state, Bucket(_names(), SIZES, _grads(comm.rank, 0), 0))
        kinds = {k[1]: type(v).__name__ for k, v in state.groups[0].operators.items()}
        return comm.stats.messages_sent, kinds

    out = run_ranks(4, fn)
    msgs, kinds = out[0]
    # recursive-doubling allgather of one message: log2(4) stages, after the NaN/Inf
    # agreement of nan_policy="propagate" (a ring allreduce of one word: 2 (P - 1))
    assert msgs == 2 + 2 * 3
    assert kinds["p2"] == "SampledThresholdBinarySearch"
    assert kinds["p0"] == "TrimmedTopK"


@pytest.mark.parametrize("method", ["natural", "qsgd"])
def test_quantized_methods_agree_on_nan_inside_their_collective(method: str) -> None:
    """nan_policy="propagate" costs a quantizer no round of its own: the collective's
    header exchange refuses NaN/Inf on every rank (checks_nonfinite), and a bucket
    step sends exactly the messages of the bare quantized allreduce."""
    from sparcml import SparseStream, sparse_allreduce

    def fn(comm):  # type: ignore[no-untyped-def]
        g = _grads(comm.rank, 0)
        state = SparcmlState(method, comm=comm)
        comm.stats.reset()
        reduce_bucket(state, Bucket(_names(), SIZES, g, 0))
        step = comm.stats.messages_sent
        comm.stats.reset()
        sparse_allreduce(SparseStream.from_dense(g), comm, algorithm="dsar_split_allgather",
                         quantizer=method, quantize="all")  # fmt: skip
        return step, comm.stats.messages_sent

    for step, bare in run_ranks(4, fn):
        assert step == bare > 0


@pytest.mark.parametrize("method", ["topk", "randomk", "topk+natural"])
@pytest.mark.parametrize("algorithm", ["ssar_recursive_double", "ssar_split_allgather"])
def test_selector_methods_agree_on_nan_inside_their_collective(method: str, algorithm: str) -> None:
    """nan_policy="propagate" costs a selector method no round of its own either: the
    accumulator's NaN/Inf flag rides in the collective's consistency header. A clean
    step sends exactly the bare sparse allreduce's messages; a step with NaN on one
    rank is refused in the header exchange and goes dense on every rank, NaN where
    dense has it, the residuals untouched."""
    from sparcml import SparseStream, sparse_allreduce

    def fn(comm):  # type: ignore[no-untyped-def]
        g = _grads(comm.rank, 0)
        state = SparcmlState(method, density=0.1, comm=comm, algorithm=algorithm)
        comm.stats.reset()
        reduce_bucket(state, Bucket(_names(), SIZES, g, 0))
        step = comm.stats.messages_sent
        residuals = {k: v.clone() for k, v in state.residuals.items()}
        comm.stats.reset()
        picked = SparseStream(torch.arange(5), torch.ones(5), g.numel())
        q = "natural" if "+" in method else None
        sparse_allreduce(picked, comm, algorithm=algorithm, quantizer=q,
                         quantize="contributions")  # fmt: skip
        bare = comm.stats.messages_sent
        bad = _grads(comm.rank, 1)
        if comm.rank == 1:
            bad[3] = float("nan")
        comm.stats.reset()
        out = reduce_bucket(state, Bucket(_names(), SIZES, bad, 1))
        nan_step = comm.stats.messages_sent
        comm.stats.reset()
        comm.allreduce(bad)
        dense = comm.stats.messages_sent
        kept = all(torch.equal(v, residuals[k]) for k, v in state.residuals.items())
        return step, bare, nan_step, dense, out, kept

    res = run_ranks(4, fn)
    want = sum(_grads(r, 1) for r in range(4)) / 4
    for step, bare, nan_step, dense, out, kept in res:
        assert step == bare > 0
        # the refused call's header exchange (at most the bare call's messages), then dense
        assert dense < nan_step <= bare + dense
        assert torch.isnan(out[3]) and kept
        others = torch.arange(out.numel()) != 3
        assert torch.allclose(out[others], want[others])
        assert torch.equal(out.nan_to_num(), res[0][4].nan_to_num())


@pytest.mark.parametrize("method", ["qsgd", "natural", "natural_dithering"])
@pytest.mark.parametrize("world", [1, 3])  # more ranks: test_quantization_independence
def test_unbiased_quantizers_are_identical_unbiased_and_bounded(method: str, world: int) -> None:
    n = 64
    trials = 200  # the band below is in standard errors of this many trials

    def fn(comm):  # type: ignore[no-untyped-def]
        outs = []
        g = _grads(comm.rank, 0, n).float()
        for seed in range(trials):
            state = SparcmlState(method, comm=comm, seed=seed)
            outs.append(reduce_bucket(state, Bucket(("w",), (n,), g, 0)))
        return torch.stack(outs)

    out = run_ranks(world, fn)
    for o in out:
        assert torch.equal(o, out[0])
    mean = sum(_grads(r, 0, n).float() for r in range(world)) / world
    samples = out[0].double()
    se = samples.std(0) / math.sqrt(trials)
    assert ((samples.mean(0) - mean).abs() <= 5 * se + 1e-6).all()
    if world == 1:  # a world of one sends nothing, so nothing is quantized
        assert torch.equal(samples[0], mean.double())
        return
    assert not torch.equal(samples[0], samples[1])  # the seed matters: really random
    # Each quantization moves a value by at most one step of its quantizer; a value
    # is quantized at most `world` times on its way (a partial sum each time, whose
    # magnitude and norm are at most the sums of the ranks'), so the mean moves by
    # at most one step of the summed magnitudes:
    #   qsgd (4 bits, s = 7 levels): ||v|| / 7;  natural: |x| (to an adjacent power
    #   of two);  natural dithering (s = 8): |x| + ||v|| 2^(1-8) (the lowest level).
    grads = [_grads(r, 0, n).float().double() for r in range(world)]
    magnitude = sum(g.abs() for g in grads)
    norms = sum(float(g.norm()) for g in grads)
    bound = {
        "qsgd": torch.full((n,), norms / 7),
        "natural": magnitude,
        "natural_dithering": magnitude + norms / 2**7,
    }[method]
    assert ((samples - mean).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("world", [1, 3])
def test_warmup_steps_are_dense(world: int) -> None:
    out = _run(world, "topk", density=0.01, warmup_steps=2)
    dense = _run(world, "dense")
    for t in range(2):
        assert torch.equal(out[0][0][t], dense[0][0][t])
    assert not torch.equal(out[0][0][2], dense[0][0][2])
    during = _run(world, "topk", steps=2, density=0.01, warmup_steps=2)
    assert not during[0][1].residuals  # nothing accumulated during warm-up


@pytest.mark.parametrize("world", [1, 3])
def test_warmup_with_momentum_correction_is_momentum_sgd(world: int) -> None:
    """Warm-up steps average u = m u + g (the optimizer runs without momentum)."""
    m = 0.9
    out = _run(world, "topk", steps=3, density=0.01, warmup_steps=2, momentum=m)
    u = torch.zeros(sum(SIZES), dtype=torch.float64)
    for t in range(2):
        mean = sum(_grads(r, t) for r in range(world)) / world
        u = m * u + mean
        assert torch.allclose(out[0][0][t], u, rtol=0, atol=1e-12)
    # the momentum carries into the first sparse step: u = m u + g before selection
    assert not torch.equal(out[0][0][2], _run(world, "topk", steps=3, density=0.01,
                                              momentum=m)[0][0][2])  # fmt: skip


def test_local_clipping_scales_by_one_over_sqrt_p() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.full((100,), 10.0, dtype=torch.float64)  # norm 100
        state = SparcmlState("topk", density=1.0, comm=comm, clip_norm=2.0)
        return reduce_bucket(state, Bucket(("w",), (100,), g, 0))

    out = run_ranks(4, fn)
    # each rank clips to 2 / sqrt(4) = 1; the mean of four identical clipped gradients
    assert torch.allclose(out[0].norm(), torch.tensor(1.0, dtype=torch.float64))


def test_residuals_survive_bucket_rebuilds() -> None:
    """Error feedback invariant across regrouped buckets: for every rank, the sum of
    what it sent plus its final residuals equals the sum of its gradients."""

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", density=0.05, comm=comm, algorithm="topka")
        sent_total = torch.zeros(sum(SIZES), dtype=torch.float64)
        names = _names()
        layouts = [[(0, 2), (2, 4)], [(0, 1), (1, 4)], [(0, 4)]]
        for t, layout in enumerate(layouts):
            g = _grads(comm.rank, t)
            offs = [0, *torch.tensor(SIZES).cumsum(0).tolist()]
            for a, b in layout:
                lo, hi = offs[a], offs[b]
                part = g[lo:hi]
                before = torch.cat(
                    [
                        state.residuals.get(n, torch.zeros(s, dtype=torch.float64))
                        for n, s in zip(names[a:b], SIZES[a:b], strict=True)
                    ]
                )
                reduce_bucket(state, Bucket(names[a:b], SIZES[a:b], part, t))
                after = torch.cat([state.residuals[n] for n in names[a:b]])
                sent_total[lo:hi] += before + part - after
        grads = sum(_grads(comm.rank, t) for t in range(len(layouts)))
        final = torch.cat([state.residuals[n] for n in names])
        return torch.allclose(sent_total + final, grads, atol=1e-12)

    assert all(run_ranks(3, fn))


def test_nan_policy_raise_names_the_rank_on_every_rank() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.ones(10)
        if comm.rank == 1:
            g[3] = float("nan")
        state = SparcmlState("topk", density=0.2, comm=comm, nan_policy="raise")
        try:
            reduce_bucket(state, Bucket(("a", "b"), (5, 5), g, 0))
        except FloatingPointError as e:
            return str(e)
        return None

    msgs = run_ranks(3, fn)
    assert all(m is not None and "rank(s) [1]" in m for m in msgs)
    assert "non-finite parameters: a" in msgs[1]


def test_nan_policy_propagate_carries_nan_like_dense() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.ones(10)
        g[3] = float("nan") if comm.rank == 0 else 1.0
        state = SparcmlState("topk", density=0.2, comm=comm)
        return reduce_bucket(state, Bucket(("w",), (10,), g, 0))

    out = run_ranks(2, fn)
    assert torch.isnan(out[0][3]) and torch.isnan(out[1][3])


def test_bad_hyperparameters_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown method 'topq'"):
        SparcmlState("topq")
    with pytest.raises(ValueError, match="density must be in"):
        SparcmlState("topk", density=0.0)
    with pytest.raises(ValueError, match="density must be in"):
        SparcmlState("topk", density=1.5)
    with pytest.raises(ValueError, match="density must be a number in"):
        SparcmlState("topk", density=True)  # (float(True) is 1: an audit found it taken)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            SparcmlState("topk", density=0.1, timeout=bad)
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        SparcmlState("topk", density=0.1, timeout="30")
    with pytest.raises(ValueError, match="unknown sparse allreduce algorithm"):
        SparcmlState("topk", algorithm="ring")
    with pytest.raises(ValueError, match="error feedback applies to sparse methods"):
        SparcmlState("qsgd", error_feedback=True)
    with pytest.raises(ValueError, match="unknown parameter"):
        SparcmlState("qsgd", compressor_params={"bitz": 4})
    with pytest.raises(ValueError, match="bits"):
        SparcmlState("qsgd", compressor_params={"bits": 3})
    with pytest.raises(ValueError, match="warmup_steps"):
        SparcmlState("topk", warmup_steps=-1)
    with pytest.raises(ValueError, match="momentum"):
        SparcmlState("topk", momentum=1.0)
    with pytest.raises(ValueError, match="nan_policy"):
        SparcmlState("topk", nan_policy="ignore")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        st.register(torch.nn.Linear(2, 2))
    assert {"dense", "topk", "oktopk", "redsync", "qsgd", "natural", "natural_dithering"} <= set(
        st.methods()
    )


def test_state_refuses_to_train_alone_under_a_launcher(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="init_process_group"):
        SparcmlState("topk")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MPICommunicator"):
        SparcmlState("topk")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert SparcmlState("topk").comm.world_size == 1


def _model(seed: int, wide: int = 8) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, wide), torch.nn.Tanh(), torch.nn.Linear(wide, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def test_sync_gradients_rejects_models_that_differ_across_ranks() -> None:
    def shapes(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", comm=comm)
        model = _model(0, wide=8 if comm.rank != 2 else 9)
        try:
            st.sync_gradients(model, state)
        except RankMismatchError as e:
            return str(e)
        return None

    msgs = run_ranks(3, shapes)
    assert all(m is not None and "ranks [2] register different parameters" in m for m in msgs)

    def values(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", comm=comm)
        model = _model(comm.rank)
        try:
            st.sync_gradients(model, state)
        except RankMismatchError as e:
            first = str(e)
        else:
            return None
        st.broadcast_parameters(model, state)
        state.registered = None
        st.sync_gradients(model, state)  # now they agree
        return first

    msgs = run_ranks(3, values)
    assert all(m is not None and "values differ across ranks: ranks [1, 2]" in m for m in msgs)


@pytest.mark.parametrize("precision", ["float32", "gradient"])
def test_a_16_bit_layer_rule_leaves_the_momentum_it_sends_whole(precision: str) -> None:
    """bf16 gradients kept in their own dtype (``residual_precision="gradient"``): the
    16-bit method's division by P used to run in place on the momentum buffer it was
    handed, so the stored momentum came out divided by P every step."""

    def fn(comm):  # type: ignore[no-untyped-def]
        w = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
        b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        state = SparcmlState(
            "topk", density=0.25, momentum=0.9, residual_precision=precision,
            layers=[("param1", "bf16")], comm=comm,
        )  # fmt: skip
        w.grad = torch.ones(64, dtype=torch.bfloat16)
        b.grad = torch.ones(8, dtype=torch.bfloat16)
        st.sync_gradients([w, b], state)
        u = state.children[0].momentum_correction.buffers["param1"]
        return u.float(), b.grad.float()

    for u, g in run_ranks(2, fn):
        assert torch.equal(u, torch.ones(8)) and torch.equal(g, torch.ones(8))


def test_broadcast_parameters_copies_frozen_parameters_and_buffers() -> None:
    """As DDP at construction: frozen parameters and buffers (BatchNorm's running
    statistics, its int64 count) come from root too, each in its own dtype; a rank
    whose model has another layout is refused, naming the difference."""

    def fn(comm):  # type: ignore[no-untyped-def]
        torch.manual_seed(comm.rank)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        model[0].bias.requires_grad_(False)
        model.half()[1].float()  # mixed dtypes
        with torch.no_grad():
            model[1].running_mean.fill_(comm.rank + 1.0)
        model[1].num_batches_tracked.fill_(10 * comm.rank + 3)
        state = SparcmlState("topk", comm=comm)
        st.broadcast_parameters(model, state)
        out = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
        other = torch.nn.Linear(4, 3) if comm.rank == 1 else model  # rank 1's differs
        try:
            st.broadcast_parameters(other, state)
        except ValueError as e:
            return out, str(e)
        return out, None

    res = run_ranks(3, fn)
    for tensors, _ in res[1:]:
        for a, b in zip(res[0][0], tensors, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert float(res[2][0][-3][0]) == 1.0 and int(res[2][0][-1]) == 3  # root's statistics
    assert res[0][1] is None and res[2][1] is None
    assert res[1][1] is not None and "differ from rank 1's in number, shape or dtype" in res[1][1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_optimizer_wrapper_trains_identically_on_every_rank(world: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        model = _model(0)
        state = SparcmlState("topk", density=0.2, comm=comm, bucket_bytes=64)
        opt = st.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, state)
        g = torch.Generator().manual_seed(comm.rank)
        losses = []
        for _ in range(20):
            x = torch.randn(16, 6, generator=g)
            y = x[:, :3].sum(1).long().clamp(0, 2)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses, state

    out = run_ranks(world, fn)
    for params, _, state in out:
        assert torch.equal(params, out[0][0])
        assert state.step == 20 and len(state.step_bytes) == 20
    losses = out[0][1]
    assert sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_natural_ina_equals_bidirectional_natural_compression(world: int) -> None:
    """Paper 004 Alg. 1 through the aggregator: the average of C_M(sum_i C_W(g_i)), where
    C_W is each worker's natural compression and C_M the aggregator's (nearest here)."""
    import numpy as np

    from sparcml.ina import AggregatorServer, natural_compress_integers
    from sparcml.ina.worker import encode_natural, worker_seed

    with AggregatorServer(master_rounding="nearest") as srv:
        server = f"{srv.address[0]}:{srv.address[1]}"

        def fn(comm):  # type: ignore[no-untyped-def]
            state = SparcmlState("natural_ina", comm=comm, server=server, job=5)
            return [
                reduce_bucket(state, Bucket(_names(), SIZES, _grads(comm.rank, t).float(), t))
                for t in range(2)
            ]

        out = run_ranks(world, fn)
    for t in range(2):
        total = np.zeros(sum(SIZES), dtype=np.int64)
        for r in range(world):
            codes, _ = encode_natural(_grads(r, t).float(), -50, world, worker_seed(0, 5, r, t))
            c = codes.astype(np.int64)
            v = np.where((c >> 6) & 1, 0, np.int64(1) << (c & 63))
            total += np.where((c >> 7) & 1, -v, v)
        codes, _ = natural_compress_integers(total, None)
        c = torch.from_numpy(codes.astype(np.int64))
        ref = torch.ldexp(torch.ones(c.numel()), ((c & 63) - 50).float())
        ref = torch.where(((c >> 6) & 1).bool(), torch.zeros_like(ref), ref)
        ref = torch.where(((c >> 7) & 1).bool(), -ref, ref)
        for o in out:
            assert torch.equal(o[t], ref / world)


def test_natural_ina_needs_an_aggregator_address() -> None:
    with pytest.raises(ValueError, match="server='host:port'"):
        SparcmlState("natural_ina")
    with pytest.raises(ValueError, match="must be 'host:port'"):
        SparcmlState("natural_ina", server="nohost")


def test_clip_scope_model_clips_the_whole_local_gradient_once() -> None:
    # RedSync sec. 3.5: the norm of the whole local gradient, not of each bucket
    def fn(comm):  # type: ignore[no-untyped-def]
        params = [torch.nn.Parameter(torch.zeros(50)) for _ in range(3)]
        for i, p in enumerate(params):
            p.grad = torch.full((50,), float(i + 1))
        state = SparcmlState(
            "topk", density=1.0, comm=comm, clip_norm=1.0, clip_scope="model", bucket_bytes=200
        )
        st.sync_gradients(params, state)
        return torch.cat([p.grad for p in params])

    got = run_ranks(2, fn)[0]
    g = torch.cat([torch.full((50,), float(i + 1)) for i in range(3)])
    want = g * ((1.0 / math.sqrt(2)) / float(g.norm()))
    assert torch.allclose(got, want, rtol=1e-5, atol=0)


def test_clip_scope_model_is_refused_by_the_ddp_hook() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        state = SparcmlState("topk", clip_norm=1.0, clip_scope="model", timeout=10)
        with pytest.raises(ValueError, match="clip_scope='model' needs the whole gradient"):
            st.register(ddp, state=state)
        del ddp  # before the group: DDP frees a group it outlives with the GIL held
    finally:
        dist.destroy_process_group()


def test_redsync_output_layer_auto_is_the_last_module_and_not_quantized() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("redsync", density=0.05, comm=comm, asq=True, min_bytes=0)
        model(torch.randn(4, 64)).sum().backward()
        st.sync_gradients(model, state)
        return {name: type(op).__name__ for (_, name), op in state.groups[0].operators.items()}

    kinds = run_ranks(1, fn)[0]
    assert kinds["0.weight"] == "ASQ" and kinds["0.bias"] == "ASQ"
    assert kinds["2.weight"] != "ASQ" and kinds["2.bias"] != "ASQ"


def _registered_methods() -> list[str]:
    """One name per registered method: its own names, and a selector and a quantizer
    for the compressor-based kinds (a new method module is picked up here)."""
    from sparcml.torch.methods.base import registered

    out = []
    for spec in registered():
        if spec.names:
            out += list(spec.names)
        else:
            out.append({"sparse": "topk+natural", "quantized": "natural"}.get(spec.kind, spec.kind))
    return out


@pytest.mark.parametrize("method", _registered_methods())
def test_every_registered_method_is_identical_on_every_rank_and_resolves_to_its_config(
    method: str,
) -> None:
    """Each method (by name, and by its typed config) gives bitwise the same average on
    every rank over 3 steps, counts its bytes, and the name's config equals the typed
    one; lossless methods equal the dense average (float tolerance: the order of sums)."""
    from sparcml.torch.methods import config_of, method_spec

    try:
        config = config_of(method, 0.1)
    except ValueError as e:  # a method needing an outside service (natural_ina's aggregator)
        pytest.skip(f"{method}: {e}")
    assert SparcmlState(config, comm=_self()).config == config
    world = 3

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState(method, density=0.1, comm=comm)
        outs = [
            reduce_bucket(state, Bucket(_names(), SIZES, _grads(comm.rank, t), t)) for t in range(3)
        ]
        return outs, state.step_bytes

    got = run_ranks(world, fn)
    for outs, step_bytes in got:
        assert all(b > 0 for b in step_bytes[:3]) and len(step_bytes) == 3
        for t, out in enumerate(outs):
            assert torch.equal(out, got[0][0][t]), (method, t)
            assert bool(torch.isfinite(out).all())
    if method_spec(method).lossless:
        for t, out in enumerate(got[0][0]):
            dense = sum(_grads(r, t) for r in range(world)) / world
            assert torch.allclose(out, dense, atol=1e-6), method


def _self():  # type: ignore[no-untyped-def]
    from sparcml.comm import SelfCommunicator

    return SelfCommunicator()


def test_warm_up_steps_of_a_sparse_gradient_are_exact_whatever_the_selector_s_algorithm() -> None:
    """A selector method's sparse (COO) gradient during warm-up goes through the exact
    sparse allreduce ('auto'), not the method's own algorithm (gtopk would drop rows)."""
    from sparcml.torch.reduce import reduce_sparse_gradient

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", 0.1, algorithm="gtopk", warmup_steps=5, comm=comm)
        rows = torch.tensor([[2 * comm.rank, 2 * comm.rank + 1]])
        g = torch.sparse_coo_tensor(rows, torch.ones(2, 2) * (comm.rank + 1), (8, 2))
        return reduce_sparse_gradient(state, Bucket(("emb.weight",), (16,), g, 0)).to_dense()

    for out in run_ranks(2, fn):
        want = torch.zeros(8, 2)
        want[0:2], want[2:4] = 0.5, 1.0
        assert torch.equal(out, want)


def test_config_errors_name_what_is_accepted() -> None:
    from sparcml.comm import SelfCommunicator

    comm = SelfCommunicator()
    with pytest.raises(ValueError, match=r"warmup_step next to the config TopK.*density"):
        SparcmlState(st.TopK(), warmup_step=5, comm=comm)
    with pytest.raises(ValueError, match="is not the config of a registered method"):
        import dataclasses

        from sparcml.torch.methods import MethodConfig

        @dataclasses.dataclass(frozen=True)
        class Mine(MethodConfig):
            pass

        SparcmlState(Mine(), comm=comm)
    assert SparcmlState("topk", warmup_steps=5.0, comm=comm).settings.warmup_steps == 5
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative integer"):
        SparcmlState("topk", warmup_steps=2.5, comm=comm)
    rule = st.LayerRule("topk", pattern="*.bias", options={"density": 0.5})
    state = SparcmlState("topk", comm=comm, layers=[rule])
    assert state.groups[1].density == 0.5


def _sparse_grads(rank: int, step: int, n: int, nnz: int | None) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``step``: ``nnz`` random non-zeros (a
    sparse-feature layer's), or dense when ``nnz`` is None."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    if nnz is None:
        return torch.randn(n, generator=g, dtype=torch.float64)
    out = torch.zeros(n, dtype=torch.float64)
    out[torch.randperm(n, generator=g)[:nnz]] = torch.randn(nnz, generator=g, dtype=torch.float64)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [1547, 70_001])  # torch.topk's path, and the one-pass search's
@pytest.mark.parametrize("momentum,masking", [(0.0, False), (0.9, False), (0.9, True)])
def test_topk_residual_known_zero_after_every_non_zero_was_sent(
    world: int, n: int, momentum: float, masking: bool
) -> None:
    """A top-k of fewer non-zeros than ``k`` sends them all: the residual is zero, and
    the next step reads the gradient alone instead of ``residual + g`` (no pass over
    the residual). Steps that send all, one that keeps a residual, one that empties
    it again, a dense one, against Alg. 1 computed densely (DGC momentum correction with masking as
    RedSync sec. 3.5: ``u = m u + g; v = v + u``, with masking ``u`` zeroed where
    sent).
    Float64 data: sums agree to 1e-12, residuals bit for bit."""
    density = 0.05
    k = _k(density, n)
    # all sent twice; k + k // 4 (k // 4 kept); all sent (k // 2 at most); dense; sparse
    plan = [k // 3, k // 2, k + k // 4, k // 4, None, k // 4]
    sizes = (n - 7, 7)

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState(
            "topk", comm=comm, density=density, momentum=momentum, momentum_masking=masking
        )
        names = ("w", "b")
        outs, known = [], []
        for t, nnz in enumerate(plan):
            g = _sparse_grads(comm.rank, t, n, nnz)
            outs.append(reduce_bucket(state, Bucket(names, sizes, g, t)))
            known.append(state.groups[0].feedback.known_zero(names, sizes, g))
        return outs, known, dict(state.residuals)

    out = run_ranks(world, fn)
    for outs, _, _ in out:
        for a, b in zip(outs, out[0][0], strict=True):
            assert torch.equal(a, b)
    eps = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    u = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for t, nnz in enumerate(plan):
        total = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            u[r] = momentum * u[r] + _sparse_grads(r, t, n, nnz)
            acc = eps[r] + u[r]
            sel = _topk(acc, k)
            eps[r] = acc - sel
            if masking:
                u[r][sel != 0] = 0.0  # momentum factor masking
            total += sel
        assert torch.allclose(out[0][0][t], total / world, rtol=0, atol=1e-12), t
    for r, (_, known, residuals) in enumerate(out):
        # a step that sends every non-zero of its accumulator leaves the residual
        # known to be zero; without masking, momentum keeps the k // 4 it did not send
        # in u, and every later accumulator holds k or more non-zeros
        expect = [True, True, False, False, False, False]
        if not momentum or masking:
            expect[3] = True
        assert known == expect, (r, known)
        kept = torch.cat([residuals["w"], residuals["b"]])
        assert torch.equal(kept, eps[r])


@pytest.mark.parametrize("n", [1547, 70_001])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_in_a_sparse_feature_gradient_found_in_the_selection(
    n: int, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``topk`` selects before its NaN/Inf check (a stateless selector): a selection
    holding every non-zero holds every NaN/Inf, and the check reads only it (a
    dense gradient of ``BRACKET_MIN`` entries or more: not even that, its one-pass
    top-k search tells). A
    sparse-feature gradient with NaN or Inf on one rank (another rank's gradient
    dense that step) still goes dense on every rank (dense's sum there), the
    residuals untouched, and the next clean step is Alg. 1's again."""
    import importlib

    sparse = importlib.import_module("sparcml.torch.methods.sparse")
    density = 0.05
    k = _k(density, n)
    checked: list[int] = []  # the sizes the method's NaN/Inf check reads
    check = sparse.all_finite
    monkeypatch.setattr(sparse, "all_finite", lambda t: checked.append(t.numel()) or check(t))

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk", comm=comm, density=density)
        names, sizes = ("w", "b"), (n - 7, 7)
        outs = []
        for t in range(3):
            g = _sparse_grads(comm.rank, t, n, None if (t, comm.rank) == (1, 0) else k // 3)
            if t == 1 and comm.rank == 1:
                g[int(g.nonzero()[0])] = bad  # a non-zero turned bad: still fewer than k
            outs.append(reduce_bucket(state, Bucket(names, sizes, g, t)))
        return outs, {k: v.clone() for k, v in state.residuals.items()}

    out = run_ranks(3, fn)
    for outs, _ in out:
        for a, b in zip(outs, out[0][0], strict=True):  # bit for bit, NaN included
            assert torch.equal(a.view(torch.int64), b.view(torch.int64))
    grads = [
        [_sparse_grads(r, t, n, None if (t, r) == (1, 0) else k // 3) for r in range(3)]
        for t in range(3)
    ]
    spot = int(grads[1][1].nonzero()[0])
    grads[1][1][spot] = bad
    # steps 0 and 2 send every non-zero: the plain mean; step 1 goes dense, where
    # rank 0's dense gradient would otherwise have sent k entries and kept the rest
    for t in range(3):
        ref = sum(grads[t]) / 3
        got = out[0][0][t]
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), t
        finite = torch.isfinite(ref)
        assert int((~finite).sum()) == (1 if t == 1 else 0)
        assert torch.equal(got[~finite].nan_to_num(), ref[~finite].nan_to_num()), t
        assert torch.allclose(got[finite], ref[finite], rtol=0, atol=1e-12), t
    assert all(float(v.abs().max()) == 0.0 for _, res in out for v in res.values())
    # the whole bucket read once: rank 0's dense gradient at step 1; else the
    # selection. From BRACKET_MIN entries up the dense gradient's top-k search saw
    # every candidate for NaN/Inf and tells (select_checked): nothing is read again
    if n >= BRACKET_MIN:
        assert len(checked) == 8 and max(checked) < n, checked
    else:
        assert len(checked) == 9 and checked.count(n) == 1 and max(checked) == n, checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nonzeros_of_is_from_dense_in_one_scan(dtype: torch.dtype) -> None:
    """``nonzeros``'s stream (one compiled scan on the CPU) is ``from_dense``'s, bit for
    bit: NaN and infinities kept, ``-0.0`` dropped, dense past SparCML's ``delta``."""
    from sparcml import SparseStream
    from sparcml.torch.methods.sparse import nonzeros_of

    g = torch.Generator().manual_seed(5)
    for n, nnz in [(0, 0), (1, 1), (1000, 10), (70_001, 300), (70_001, 60_000), (300_000, 4000)]:
        x = torch.zeros(n, dtype=torch.float64)
        x[torch.randperm(n, generator=g)[:nnz]] = torch.randn(nnz, generator=g, dtype=torch.float64)
        x = x.to(dtype)
        if nnz >= 4:
            special = torch.tensor([float("nan"), -float("inf"), 1e-30], dtype=dtype)
            x[torch.nonzero(x).flatten()[:3]] = special
        if n >= 3:
            x[n - 1] = -0.0
        want = SparseStream.from_dense(x)
        got = nonzeros_of(x.clone())
        assert got.is_dense == want.is_dense, (n, nnz)
        if not want.is_dense:
            assert torch.equal(got.indices, want.indices), (n, nnz)
        same = got.values.view(
            torch.int16
            if dtype.itemsize == 2
            else torch.int64
            if dtype.itemsize == 8
            else torch.int32
        )
        ref = want.values.view(same.dtype)
        assert torch.equal(same, ref), (n, nnz)
