"""Compression operators: selectors, quantizers, composition, packing, bad input.

Statistical checks use M seeded draws and 5-standard-error bands (per entry for
unbiasedness; for second moments the estimate minus 4 standard errors must not
exceed the theorem's bound), so a correct operator fails with negligible
probability and a biased one (bias above a few standard errors) is caught.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparcml import compress as C
from sparcml.compress.asq import ASQ
from sparcml.compress.packing import pack_bits, packed_nbytes, unpack_bits
from sparcml.errors import WireFormatError
from sparcml.finite import all_finite
from sparcml.stream import SUPPORTED_DTYPES


def _x(n: int = 1000, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        dtype
    )


# ----------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", list(range(1, 17)))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_roundtrip_and_sizes(bits: int, n: int) -> None:
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    buf = pack_bits(codes, bits)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_nbytes(n, bits)
    if bits in (1, 2, 4, 8):
        assert buf.numel() == math.ceil(n * bits / 8)
    if bits == 9:
        assert buf.numel() == math.ceil(9 * n / 8)
    assert torch.equal(unpack_bits(buf, n, bits), codes.to(torch.int32))
    with pytest.raises(ValueError, match="packed buffer"):
        unpack_bits(torch.cat([buf, torch.zeros(1, dtype=torch.uint8)]), n, bits)


# ----------------------------------------------------------------------------- selectors
@pytest.mark.parametrize("n,k", [(1, 1), (10, 0), (10, 10), (1000, 7), (4099, 100)])
def test_topk_equals_torch_topk(n: int, k: int) -> None:
    x = _x(n)
    s = C.get("topk", k=k).select(x)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(s.indices, ref) and torch.equal(s.values, x[ref])
    payload, ctx = C.get("topk", k=k).compress(x.reshape(-1, 1))
    y = C.get("topk", k=k).decompress(payload, ctx)
    assert y.shape == (n, 1) and torch.equal(y.reshape(-1)[ref], x[ref])


def test_selector_k_density_rules() -> None:
    x = _x(100)
    assert C.get("topk", density=0.05).select(x).nnz == 5
    assert C.get("topk", density=0.001).select(x).nnz == 1  # at least one
    with pytest.raises(ValueError, match="k=101 exceeds"):
        C.get("topk", k=101).select(x)
    for bad in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="density must lie in"):
            C.get("topk", density=bad)
    with pytest.raises(ValueError, match="exactly one of k and density"):
        C.get("topk", k=1, density=0.1)
    with pytest.raises(ValueError, match="non-negative integer"):
        C.get("topk", k=-1)
    with pytest.raises(TypeError, match="float32, float16"):
        C.get("topk", k=1).select(torch.arange(5))
    assert C.get("topk", density=0.5).select(torch.empty(0)).nnz == 0


@pytest.mark.parametrize(
    "name", ["topk", "trimmed_topk", "threshold_bsearch", "threshold_reuse", "gaussiank"]
)
def test_nan_is_selected_not_dropped(name: str) -> None:
    x = _x(2000)
    x[17] = float("nan")
    s = C.get(name, k=20).select(x)
    assert 17 in s.indices.tolist()


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_trimmed_topk_equals_exact_topk(dtype: torch.dtype) -> None:
    for seed, n, k in [(0, 10_000, 10), (1, 5000, 50), (2, 300, 299)]:
        x = _x(n, seed, dtype)
        s = C.get("trimmed_topk", k=k).select(x)
        ref = C.get("topk", k=k).select(x)
        assert torch.equal(s.indices, ref.indices)
    heavy = torch.zeros(1000)
    heavy[[3, 500]] = torch.tensor([1e6, -2e6])
    assert C.get("trimmed_topk", k=5).select(heavy).nnz == 5  # all-zero tail: thresholds fall to 0


def test_threshold_bsearch_between_k_and_2k_and_contains_topk() -> None:
    for seed in range(5):
        x = _x(20_000, seed)
        k = 50 + 30 * seed
        s = C.get("threshold_bsearch", k=k).select(x)
        assert k <= s.nnz <= 2 * k
        top = set(torch.topk(x.abs(), k).indices.tolist())
        assert top <= set(s.indices.tolist())


def test_sampled_bsearch_and_threshold_reuse_refresh_on_schedule() -> None:
    # A slowly changing gradient (as between training steps): the reused
    # thresholds keep the count in band, so only the schedule refreshes.
    sampled = C.get("sampled_threshold_bsearch", k=20)
    reuse = C.get("threshold_reuse", k=20, interval=3)
    base = _x(5000, 99)
    for step in range(11):
        x = base + 1e-3 * _x(5000, step)
        sampled.select(x)
        s = reuse.select(x)
        if step % 3 == 0:  # a refresh step: exact top-k
            assert torch.equal(s.indices, C.get("topk", k=20).select(x).indices)
    assert sampled.searches == math.ceil(11 / 5)  # calls 0, 5, 10
    assert reuse.refreshes == math.ceil(11 / 3)  # calls 0, 3, 6, 9


def test_reused_thresholds_search_again_when_the_gradient_drifts() -> None:
    # Beyond the papers: a reused threshold whose count leaves the band triggers
    # a new search at once (RedSync's [k, 2k]; threshold reuse's [k/2, 2k]).
    sampled = C.get("sampled_threshold_bsearch", k=20)
    reuse = C.get("threshold_reuse", k=20, interval=32)
    for step in range(6):
        x = _x(5000, step) * (4.0**step)  # the scale grows 4x per step
        a, b = sampled.select(x), reuse.select(x)
        assert 20 <= a.nnz <= 40 and 10 <= b.nnz <= 40, (step, a.nnz, b.nnz)
    assert sampled.searches == 6 and reuse.refreshes == 6


def test_randomk_seeded_agreement() -> None:
    a, b, c = (
        C.get("randomk", k=30, seed=7),
        C.get("randomk", k=30, seed=7),
        C.get("randomk", k=30, seed=8),
    )
    x, y = _x(1000, 1), _x(1000, 2)
    sa, sb, sc = a.select(x), b.select(y), c.select(x)
    assert torch.equal(sa.indices, sb.indices) and sa.nnz == 30
    assert not torch.equal(sa.indices, sc.indices)
    assert not torch.equal(a.select(x).indices, sa.indices)  # the next call draws anew
    scaled = C.get("randomk", k=10, seed=1, scale=True).select(torch.ones(100))
    assert torch.allclose(scaled.values, torch.full((10,), 10.0))


def test_blocktopk_keeps_b_of_every_block() -> None:
    x = _x(512 * 3 + 100)
    s = C.get("blocktopk", per_block=4, block=512).select(x)
    assert s.nnz == 4 * 4
    for blk in range(4):
        lo, hi = blk * 512, min((blk + 1) * 512, x.numel())
        mine = s.indices[(s.indices >= lo) & (s.indices < hi)]
        ref = torch.topk(x[lo:hi].abs(), 4).indices.sort().values + lo
        assert torch.equal(mine, ref)
    with pytest.raises(ValueError, match="per_block"):
        C.get("blocktopk", per_block=600, block=512)
    with pytest.raises(ValueError, match="block size"):
        C.get("blocktopk", block=0)


def test_gaussiank_selects_about_k() -> None:
    x = _x(100_000, 3)
    for k in (100, 1000, 10_000):
        assert 0.5 * k <= C.get("gaussiank", k=k).select(x).nnz <= 1.5 * k


def test_asq_alternates_signs_and_sends_no_signs() -> None:
    op = C.get("asq", k=10)
    x = _x(1000, 4)
    p1, ctx = op.compress(x)
    y1 = op.decompress(p1, ctx)
    p2, _ = op.compress(x)
    y2 = op.decompress(p2, ctx)
    pos = x.topk(10).indices.sort().values
    neg = (-x).topk(10).indices.sort().values
    assert torch.equal(y1.nonzero().flatten(), pos) and torch.allclose(
        y1[pos], x[pos].mean().expand(10)
    )
    assert torch.equal(y2.nonzero().flatten(), neg) and bool((y2[neg] < 0).all())
    assert p1.numel() == ASQ.payload_size(1000, 10) == 16 + 4 + 8 + 10 * 2


# ----------------------------------------------------------------------------- quantizers
def _draws(op, x: torch.Tensor, m: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(m):
        p, ctx = op.compress(x)
        out.append(op.decompress(p, ctx).double())
    return torch.stack(out)


def _assert_unbiased(draws: torch.Tensor, x: torch.Tensor) -> None:
    m = draws.shape[0]
    mean = draws.mean(0)
    se = draws.std(0) / math.sqrt(m)
    assert bool(((mean - x.double()).abs() <= 5 * se + 1e-9).all())


def _second_moment(draws: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """Estimate of E||C(x)-x||^2 / ||x||^2 and its standard error."""
    r = ((draws - x.double()) ** 2).sum(1) / (x.double() ** 2).sum()
    return float(r.mean()), float(r.std() / math.sqrt(r.numel()))


def test_natural_unbiased_with_variance_one_eighth() -> None:
    x = _x(256, 5) * torch.logspace(-3, 3, 256)
    draws = _draws(C.get("natural", seed=1), x, 3000)
    _assert_unbiased(draws, x)
    est, se = _second_moment(draws, x)
    assert est - 4 * se <= 1 / 8  # Thm 1: omega = 1/8
    # the worst case x = 4/3 * 2^a reaches omega = 1/8 exactly (second moment 9/8 x^2)
    worst = torch.full((64,), 4.0 / 3.0)
    est, se = _second_moment(_draws(C.get("natural", seed=2), worst, 3000), worst)
    assert abs(est - 1 / 8) <= 4 * se + 1e-3


@pytest.mark.parametrize("fmt", [9, 8])
def test_natural_without_a_seed_draws_anew_and_stays_unbiased(fmt: int) -> None:
    """``seed=None`` draws from torch's default generator: the compiled 9-bit CPU
    pass used to draw only with a generator, so every 1.5 came back as 2 (its
    scratch draws zero) and every call repeated the last draws."""
    torch.manual_seed(0)
    op = C.get("natural", seed=None, format=fmt)
    x = torch.full((20000,), 1.5)
    outs = [op.dequantize(op.quantize(x), torch.float32, x.device) for _ in range(3)]
    for out in outs:
        assert abs(float(out.mean()) - 1.5) < 0.02  # +-1.5 / sqrt(20000) * 0.5 * 4 sigma
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("fmt", [9, 8])
def test_natural_formats_values_and_sizes(fmt: int) -> None:
    n = 1001
    x = _x(n, 6)
    x[0] = 0.0
    op = C.get("natural", format=fmt)
    p, ctx = op.compress(x)
    assert p.numel() == op.expected_nbytes(n) == 16 + (math.ceil(9 * n / 8) if fmt == 9 else n)
    y = op.decompress(p, ctx)
    nz = y != 0
    assert y[0] == 0
    assert torch.equal(torch.sign(y[nz]), torch.sign(x[nz]))
    mant, _ = torch.frexp(y[nz].abs())
    assert bool((mant == 0.5).all())  # powers of two
    ratio = y[nz].abs() / x[nz].abs()
    assert bool((ratio >= 0.5).all()) and bool((ratio <= 2.0).all())


def test_natural_8bit_small_values_stay_unbiased_and_clip_is_counted() -> None:
    op = C.get("natural", format=8, e_min=-10, seed=3)
    x = torch.full((64,), 2.0**-12)  # below 2^e_min: 0 or 2^-10 with probability 1/4
    _assert_unbiased(_draws(op, x, 3000), x)
    big = torch.tensor([2.0**60])
    p, ctx = op.compress(big)
    assert op.decompress(p, ctx).item() == 2.0**53 and op.clipped == 1


def test_natural_deterministic_rounds_to_nearer_power() -> None:
    op = C.get("natural", deterministic=True)
    x = torch.tensor([1.2, 1.6, -3.0, 0.7, 5.9])
    p, ctx = op.compress(x)
    assert op.decompress(p, ctx).tolist() == [1.0, 2.0, -4.0, 0.5, 4.0]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_unbiased_variance_bound_and_size(bits: int) -> None:
    bucket = 64
    x = _x(256, 7)
    op = C.get("qsgd", bits=bits, bucket=bucket, seed=4)
    draws = _draws(op, x, 2000)
    _assert_unbiased(draws, x)
    s = (1 << (bits - 1)) - 1
    est, se = _second_moment(draws, x)
    assert est - 4 * se <= min(bucket / s**2, math.sqrt(bucket) / s)  # QSGD Lemma 3.1
    p, _ = op.compress(_x(1000))
    assert p.numel() == 16 + 4 * math.ceil(1000 / bucket) + math.ceil(1000 * bits / 8)


def test_qsgd_max_norm_and_zero_bucket() -> None:
    x = torch.zeros(300)
    x[:5] = torch.tensor([1.0, -2.0, 0.5, 0.0, 2.0])
    op = C.get("qsgd", bits=8, bucket=100, norm="max")
    p, ctx = op.compress(x)
    y = op.decompress(p, ctx)
    assert bool((y[100:] == 0).all()) and y[4] == 2.0 and y[1] == -2.0


@pytest.mark.parametrize("name", ["dithering", "natural_dithering"])
def test_dithering_unbiased(name: str) -> None:
    x = _x(128, 8)
    _assert_unbiased(_draws(C.get(name, levels=4, seed=5), x, 3000), x)
    _assert_unbiased(_draws(C.get(name, levels=3, p=float("inf"), compress_norm=True), x, 3000), x)


def test_natural_dithering_beats_standard_dithering() -> None:
    d, s = 128, 4
    x = _x(d, 9)
    nat_est, nat_se = _second_moment(_draws(C.get("natural_dithering", levels=s), x, 2000), x)
    std_est, std_se = _second_moment(_draws(C.get("dithering", levels=s), x, 2000), x)
    r = 2  # min(p, 2) for p = 2
    omega = 1 / 8 + d ** (1 / r) * 2 ** (1 - s) * min(1, d ** (1 / r) * 2 ** (1 - s))
    assert nat_est - 4 * nat_se <= omega  # Thm 4
    assert nat_est + 4 * nat_se < std_est - 4 * std_se  # Thm 5: smaller variance, same s


@pytest.mark.parametrize("name", ["qsgd", "natural", "dithering", "natural_dithering"])
def test_quantizers_refuse_non_finite_and_handle_empty(name: str) -> None:
    op = C.get(name)
    for bad in (float("nan"), float("inf")):
        x = _x(50)
        x[9] = bad
        with pytest.raises(ValueError, match=r"non-finite value .* at flat index 9"):
            op.compress(x)
    p, ctx = op.compress(torch.empty(0))
    assert op.decompress(p, ctx).numel() == 0
    p, ctx = op.compress(torch.zeros(10))
    assert bool((op.decompress(p, ctx) == 0).all())
    with pytest.raises(TypeError, match="float32"):
        op.compress(torch.arange(4))


def _natural9_by_torch_ops(v: torch.Tensor, seed: int, deterministic: bool):  # type: ignore[no-untyped-def]
    """The 9-bit payload body and clip count by the torch operations (the CUDA path)."""
    from sparcml.compress._kernels import chunks
    from sparcml.compress.natural import natural_round
    from sparcml.compress.packing import pack_bools

    gen = None if deterministic else torch.Generator().manual_seed(seed)
    exps, signs, clipped = [], [], 0
    for lo, hi in chunks(v.numel(), v.device):
        sign, exp, _, c = natural_round(v[lo:hi], gen, deterministic)
        exps.append(exp.to(torch.uint8))
        signs.append(sign.clone())
        clipped += c
    n = v.numel()
    plane = pack_bools(torch.cat(signs)) if n else torch.empty(0, dtype=torch.uint8)
    return torch.cat([*exps, plane[: (n + 7) // 8]]) if n else plane, clipped


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1000, (1 << 18) + 13])
def test_natural9_compiled_cpu_pass_equals_the_torch_ops(n: int, deterministic: bool) -> None:
    # the CPU's fused pass against the torch operations the CUDA path runs: the
    # same draws give the same bytes, chunk boundaries included; special values:
    # zeros of both signs, subnormals, the top binade (clipped), powers of two
    g = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 120, (n,), generator=g))
    special = [0.0, -0.0, 1e-45, -3e-39, 2.0**127 * 1.9, -(2.0**127) * 1.99, 1.0, -0.5]
    v[: min(n, len(special))] = torch.tensor(special[: min(n, len(special))])
    q = C.get("natural", deterministic=deterministic, seed=None)
    payload = q.quantize(v, torch.Generator().manual_seed(7))
    body, clipped = _natural9_by_torch_ops(v, 7, deterministic)
    assert torch.equal(payload[16:], body)
    assert q.clipped == clipped
    # expected float32 bits as unsigned int64: exponent << 23 | sign << 31
    sign = (body[n:].repeat_interleave(8)[:n].to(torch.int64) >> torch.arange(n) % 8) & 1
    want = (body[:n].to(torch.int64) << 23) | (sign << 31)
    got = q.dequantize(payload, torch.float32, v.device).view(torch.int32).to(torch.int64)
    assert torch.equal(got & 0xFFFFFFFF, want)
    # NaN/Inf mapped as documented when not refused: the same bytes either way
    if n >= 3:
        v[1], v[2] = float("nan"), float("-inf")
        q = C.get("natural", deterministic=deterministic, check_finite=False)
        payload = q.quantize(v, torch.Generator().manual_seed(7))
        assert torch.equal(payload[16:], _natural9_by_torch_ops(v, 7, deterministic)[0])


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    # the one-reduction check against torch.isfinite(x).all(): each kind of bad
    # value at each end and in the middle, strided and one-element views, empty,
    # and finite values whose sum (not their extremes) would overflow
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1001, generator=g).to(dtype)
    assert all_finite(x) and all_finite(x[::7]) and all_finite(x[:0])
    big = torch.finfo(dtype).max
    assert all_finite(torch.tensor([big, big, -big], dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 500, 1000):
            y = x.clone()
            y[at] = bad
            assert not all_finite(y), (bad, at)
            assert all_finite(y[::3]) == bool(torch.isfinite(y[::3]).all()), (bad, at)
            assert not all_finite(y[at:][:1].as_strided((1,), (5,)))
    assert all_finite(torch.arange(5)) and all_finite(torch.zeros(3, dtype=torch.bool))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("name", ["qsgd", "natural", "natural_dithering"])
def test_quantizers_keep_dtype_and_shape(dtype: torch.dtype, name: str) -> None:
    x = _x(60, 1, dtype).reshape(3, 4, 5)
    op = C.get(name)
    p, ctx = op.compress(x)
    y = op.decompress(p, ctx)
    assert y.shape == x.shape and y.dtype == dtype


def test_bad_hyperparameters() -> None:
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        C.get("qsgd", bits=3)
    with pytest.raises(ValueError, match="bucket size"):
        C.get("qsgd", bucket=0)
    with pytest.raises(ValueError, match="format must be 9 or 8"):
        C.get("natural", format=7)
    with pytest.raises(ValueError, match="levels"):
        C.get("dithering", levels=0)


def test_corrupt_payloads_are_rejected() -> None:
    op = C.get("qsgd")
    p, ctx = op.compress(_x(100))
    with pytest.raises(WireFormatError):
        op.decompress(p[:-1], ctx)
    with pytest.raises(WireFormatError, match="operator code"):
        C.get("natural").decompress(p, ctx)
    with pytest.raises(WireFormatError, match="4-bit codes"):
        C.get("qsgd", bits=8).decompress(p, ctx)


# ----------------------------------------------------------------------------- composition
def test_composition_and_registry_errors() -> None:
    op = C.get("topk+natural", density=0.05, seed=3)
    assert isinstance(op, C.Composed) and op.name == "topk+natural"
    x = _x(2000, 10)
    p, ctx = op.compress(x)
    y = op.decompress(p, ctx)
    top = torch.topk(x.abs(), 100).indices.sort().values
    assert torch.equal(y.nonzero().flatten(), top)
    # header 16 + nnz 8 + 2-byte indices + natural payload (16 + ceil(9k/8))
    assert p.numel() == 16 + 8 + 100 * 2 + 16 + math.ceil(9 * 100 / 8)
    assert C.Composed(C.get("randomk", k=3), C.get("qsgd", bits=2)).name == "randomk+qsgd"
    with pytest.raises(ValueError, match="unknown compressor 'fancy'"):
        C.get("fancy")
    with pytest.raises(ValueError, match="unknown parameter"):
        C.get("topk+natural", density=0.1, bitz=4)
    with pytest.raises(ValueError, match="is not a selector"):
        C.get("natural+topk", k=3)
    with pytest.raises(ValueError, match="at most one"):
        C.get("topk+natural+qsgd", k=1)
    assert C.available()["topk"] == "selector" and C.available()["qsgd"] == "quantizer"


def test_composition_is_unbiased_on_the_selection() -> None:
    x = _x(500, 11)
    op = C.get("topk+natural", k=50, seed=9)
    draws = _draws(op, x, 2000)
    top = torch.topk(x.abs(), 50).indices
    _assert_unbiased(draws[:, top], x[top])


def test_natural_to_integers_refuses_offset_63_instead_of_flipping_sign() -> None:
    q = C.get("natural", format=8, e_min=-10)
    x = torch.tensor([2.0**53, -(2.0**52), 1.0])  # offsets 63, 62, 10
    payload = q.quantize(x)
    with pytest.raises(OverflowError, match="int64"):
        q.to_integers(payload)
    ok = q.quantize(torch.tensor([-(2.0**52), 1.0]))
    assert q.to_integers(ok).tolist() == [-(2**62), 2**10]


def test_natural_9bit_top_binade_clipped_and_counted() -> None:
    # [2^127, 2^128): rounding up gives 2^128 = inf; clipped to 2^127 and counted
    q = C.get("natural", seed=5)
    x = torch.full((4096,), 1.5 * 2.0**127)
    out = q.dequantize(q.quantize(x), torch.float32, torch.device("cpu"))
    assert bool(torch.isfinite(out).all()) and bool((out == 2.0**127).all())
    assert 1500 < q.clipped < 2600  # about half rounded up


@pytest.mark.parametrize("fmt", [8, 9])
def test_natural_below_range_flushes_unbiased_in_both_formats(fmt: int) -> None:
    # below the smallest power (2^e_min, or 2^-126 for 9-bit subnormals) both formats
    # round stochastically to 0 or that power: unbiased (documented variance)
    lo = 2.0**-20 if fmt == 8 else 2.0**-126
    q = C.get("natural", format=fmt, e_min=-20, seed=11)
    x = torch.full((200_000,), 0.3 * lo)
    out = q.dequantize(q.quantize(x), torch.float64, torch.device("cpu"))
    assert set(out.unique().tolist()) <= {0.0, lo}
    mean, se = float(out.mean()), lo * math.sqrt(0.3 * 0.7 / x.numel())
    assert abs(mean - 0.3 * lo) < 5 * se


@pytest.mark.parametrize("kind", ["randn", "ties", "sorted", "heavy_tail", "sparse", "reversed"])
@pytest.mark.parametrize("n", [1 << 16, 300_007])
def test_kth_largest_is_exact(kind: str, n: int) -> None:
    """The bracketed search (strided sample, count above, exact top-k of the band)
    equals torch.topk's k-th largest on every kind of data, falling back when the
    sample's bracket misses (sorted and reversed inputs, massive ties)."""
    from sparcml.compress.threshold_reuse import kth_largest

    g = torch.Generator().manual_seed(n)
    x = {
        "randn": lambda: torch.randn(n, generator=g).abs(),
        "ties": lambda: torch.randint(0, 50, (n,), generator=g).float(),
        "sorted": lambda: torch.arange(n, dtype=torch.float32),
        "heavy_tail": lambda: torch.randn(n, generator=g).abs() ** 6,
        "sparse": lambda: torch.zeros(n).index_fill_(0, torch.arange(0, n, 97), 1.0),
        "reversed": lambda: torch.arange(n, 0, -1, dtype=torch.float32),
    }[kind]()
    for k in (1, 7, n // 1000, n // 100, n // 10, n // 4, n // 2, n):
        k = max(k, 1)
        assert kth_largest(x, k) == float(torch.topk(x, k).values.min()), (kind, n, k)
    for dtype in (torch.float64, torch.float16):  # the compiled scan; torch's masks
        y = x.to(dtype)
        for k in (7, n // 100):
            assert kth_largest(y, k) == float(torch.topk(y, k).values.min()), (dtype, kind, k)


@pytest.mark.parametrize("kind", ["randn", "ties", "sparse"])
def test_top_k_positions_are_the_top_k_with_ties_broken_by_position(kind: str) -> None:
    """Given the k-th largest ``t``: every entry above ``t``, then the entries equal
    to ``t`` in index order, k in all (k-th largest tied or not), sorted."""
    from sparcml.compress.threshold_reuse import kth_largest, top_k_positions

    n = 100_003
    g = torch.Generator().manual_seed(5)
    mag = {
        "randn": lambda: torch.randn(n, generator=g).abs(),
        "ties": lambda: torch.randint(0, 50, (n,), generator=g).float(),
        "sparse": lambda: torch.zeros(n).index_fill_(0, torch.arange(0, n, 97), 1.0),
    }[kind]()
    for k in (1, 50, 1000, 2000, 30_000):
        t = kth_largest(mag, k)
        got = top_k_positions(mag, t, k)
        above = (mag > t).nonzero().flatten()
        tied = (mag == t).nonzero().flatten()
        want = above if t == 0 else torch.cat([above, tied[: k - above.numel()]]).sort().values
        assert torch.equal(got, want), (kind, k)
        assert t == 0 or got.numel() == k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 18) + 77])
def test_select_above_is_the_comparison_it_replaces(dtype: torch.dtype, n: int) -> None:
    """The compiled scan (bit patterns, one pass) selects exactly ``|x| >= t``
    (``> t`` strict) with NaN always selected, for every dtype, threshold and layout."""
    from sparcml.compress.selection import select_above

    g = torch.Generator().manual_seed(n)
    base = torch.randn(2 * n, generator=g).to(dtype)
    if n > 4:
        base[[0, 3]] = float("nan")
        base[5] = float("-inf")
        base[6:10] = 1.0  # ties
        base[10] = -0.0
    x = base[::2]  # strided
    mag = x.abs().double()
    for t in (0.0, 0.3, 1.0, 1.7, float("inf")):
        for strict in (True, False):
            tt = float(torch.tensor(t, dtype=dtype))  # the comparison's rounding
            ref = ((mag > tt if strict else mag >= tt) | mag.isnan()).nonzero().flatten()
            got = select_above(x, t, strict=strict)
            assert torch.equal(got, ref), (t, strict)


def _params(name: str) -> dict[str, object]:
    """A density for the operators that take one (the others: their defaults)."""
    import inspect

    cls = C.base.operator_class(name)
    assert cls is not None
    return {"density": 0.05} if "density" in inspect.signature(cls.__init__).parameters else {}


@pytest.mark.parametrize("name", sorted(C.available()))
def test_every_registered_operator_keeps_the_contract(name: str) -> None:
    """Every operator in the registry (a new module is picked up here): a selector
    returns a stream over its input (sorted unique indices, the input's own values,
    nothing from an empty input); every operator's payload decompresses to the
    input's shape and dtype, finite, and the same payload decodes the same way."""
    x = _x(1000, seed=3)
    op = C.get(name, **_params(name))
    if C.available()[name] == "selector":
        s = op.select(x)
        assert s.size == x.numel() and 0 < s.nnz <= x.numel()
        if not s.is_dense:
            assert bool((s.indices[1:] > s.indices[:-1]).all())
            assert torch.equal(s.values, x[s.indices])
        assert C.get(name, **_params(name)).select(torch.empty(0)).nnz == 0
    payload, ctx = op.compress(x.reshape(20, 50))
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    y = op.decompress(payload, ctx)
    assert y.shape == (20, 50) and y.dtype == x.dtype and all_finite(y)
    assert torch.equal(op.decompress(payload, ctx), y)


@pytest.mark.parametrize(
    "kind",
    ["randn", "ties", "sorted", "heavy_tail", "sparse", "reversed", "nan_inf", "hidden", "sampled"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_exact_in_one_pass_equals_the_general_path(kind: str, dtype: torch.dtype) -> None:
    """The one-pass selection on bit patterns gives the threshold and positions of
    ``magnitude`` + ``kth_largest`` + ``top_k_positions`` bit for bit: signed data,
    ties broken by position, NaN above +-inf (ranked with the largest finite value),
    large entries the sample does not see (``hidden``) or the only ones it sees
    (``sampled``: it misses for k above n / 12, the general path answers), and
    strided input."""
    from sparcml.compress.selection import magnitude
    from sparcml.compress.threshold_reuse import (
        _by_bits,
        kth_largest,
        kth_magnitude,
        top_k_exact,
        top_k_positions,
    )

    n = 200_003
    g = torch.Generator().manual_seed(11)
    x = {
        "randn": lambda: torch.randn(n, generator=g),
        "ties": lambda: torch.randint(-50, 50, (n,), generator=g).float(),
        "sorted": lambda: torch.arange(n, dtype=torch.float32) - n // 2,
        "heavy_tail": lambda: torch.randn(n, generator=g) ** 7,
        "sparse": lambda: torch.zeros(n).index_fill_(0, torch.arange(0, n, 97), -1.0),
        "reversed": lambda: torch.arange(n, 0, -1, dtype=torch.float32),
        "nan_inf": lambda: (
            torch.randn(n, generator=g)
            .index_fill_(0, torch.arange(5, n, 1009), float("nan"))
            .index_fill_(0, torch.arange(7, n, 1013), float("-inf"))
        ),
        "hidden": lambda: (torch.randn(n, generator=g) * 1e-3).index_fill_(
            0,
            torch.arange(1, n, 12),
            5.0,  # the sample's stride is n // 2^14 = 12
        ),
        "sampled": lambda: (torch.randn(n, generator=g) * 1e-3).index_fill_(
            0,
            torch.arange(0, n, 12),
            5.0,  # the sample sees only these: it misses
        ),
    }[kind]().to(dtype)
    for y in (x, torch.stack([x, x], 1)[:, 1]):  # contiguous and strided
        for k in (1, 7, n // 1000, n // 100, n // 10, n // 4):
            mag = magnitude(y)
            t = kth_largest(mag, k)
            want = top_k_positions(mag, t, k)
            got_t, got = top_k_exact(y, k)
            assert got_t == t and torch.equal(got, want), (kind, dtype, k)
            assert t == 0 or got.numel() == k
            assert kth_magnitude(y, k) == t, (kind, dtype, k)
    if kind in ("randn", "ties", "heavy_tail", "hidden", "nan_inf"):
        for k in (7, n // 100):  # the one pass answered (not the general path)
            assert _by_bits(x, k, positions=True) is not None, (kind, k)


@pytest.mark.parametrize("kind", ["randn", "ties", "nan_inf", "few", "many"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_of_entries_is_the_dense_selection(kind: str, dtype: torch.dtype) -> None:
    """``TopK.select_entries`` of a vector's non-zeros gives ``select_covering`` of
    the dense vector bit for bit (positions, values, covering) at sizes of at least
    ``BRACKET_MIN``: ties at the k-th magnitude broken by position, NaN and
    infinities ranked as the dense selection ranks them, fewer than ``k`` non-zeros
    all taken (covering), ``-0.0`` never an entry, and (``many``) entries enough for
    ``top_k_exact``'s one pass over them."""
    from sparcml.compress.threshold_reuse import BRACKET_MIN
    from sparcml.compress.topk import TopK
    from sparcml.stream import SparseStream

    n = 4 * BRACKET_MIN + 5 if kind == "many" else BRACKET_MIN + 5
    g = torch.Generator().manual_seed(5)
    m = {"few": 40, "many": BRACKET_MIN + 3000}.get(kind, 3000)
    support = torch.randperm(n, generator=g)[:m].sort().values
    vals = {
        "randn": lambda m: torch.randn(m, generator=g),
        "ties": lambda m: (
            torch.randint(1, 4, (m,), generator=g).float()
            * (1 - 2 * torch.randint(0, 2, (m,), generator=g))
        ),
        "nan_inf": lambda m: (
            torch.randn(m, generator=g)
            .index_fill_(0, torch.arange(3, m, 301), float("nan"))
            .index_fill_(0, torch.arange(9, m, 307), float("-inf"))
        ),
        "few": lambda m: torch.randn(m, generator=g),
        "many": lambda m: torch.randn(m, generator=g),
    }[kind](support.numel()).to(dtype)
    x = torch.zeros(n, dtype=dtype)
    x[support] = vals
    x[support[:5]] = -0.0  # stored zeros: not entries (the caller drops them)
    keep = x[support] != 0
    entries = SparseStream.from_sorted(support[keep], x[support][keep], n)
    for density in (0.0001, 0.01, 0.04):
        sel = TopK(density=density)
        want, want_cov = sel.select_covering(x)
        got, got_cov = sel.select_entries(entries)
        assert torch.equal(got.indices, want.indices), (kind, density)
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
        assert got_cov == want_cov == (kind == "few" and sel.spec.of(n) > entries.nnz)


def test_top_k_exact_falls_back_when_infinities_rank_below_the_sample() -> None:
    """NaN at 40 sampled positions makes the sample's t_lo = +inf; the scan keeps
    the NaN and the 80 infinities (k or more), but infinities rank with the largest
    finite value (magnitude()'s order), below NaN, so fewer than k candidates reach
    t_lo: the one pass must hand over to the general path, whose answer includes
    finite FLT_MAX entries the scan at t_lo left out."""
    from sparcml.compress.selection import magnitude
    from sparcml.compress.threshold_reuse import _by_bits, kth_largest, top_k_exact, top_k_positions

    n = 200_003  # sample stride 12
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x[torch.arange(7, 7 + 30 * 89, 89)] = torch.finfo(torch.float32).max
    x[torch.arange(5, 5 + 80 * 97, 97)] = float("-inf")
    x[torch.arange(0, 40 * 12, 12)] = float("nan")  # 40 NaN + 80 inf: 120 candidates
    k = 100
    assert _by_bits(x, k, positions=True) is None
    mag = magnitude(x)
    t = kth_largest(mag, k)
    got_t, got = top_k_exact(x, k)
    assert got_t == t == torch.finfo(torch.float32).max
    assert torch.equal(got, top_k_positions(mag, t, k)) and got.numel() == k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", ["none", "nan", "inf", "-inf", "inf_past_k", "zeros"])
def test_topk_tells_whether_the_accumulator_is_finite(bad: str, dtype: torch.dtype) -> None:
    """``TopK.select_checked`` is ``select_covering`` plus ``isfinite(x).all()``
    where its one-pass search saw every candidate for NaN/Inf, None elsewhere: a
    lone non-finite entry anywhere; more infinities than k (``inf_past_k``: 50 and
    a NaN, k = 10, so 40 of them left out of the selection); and a tensor with
    fewer non-zeros than k (the scan for non-zeros: not known)."""
    from sparcml.compress.topk import TopK

    n = 100_003
    g = torch.Generator().manual_seed(17)
    x = torch.randn(n, generator=g, dtype=dtype)
    if bad in ("nan", "inf", "-inf"):
        x[int(torch.randint(0, n, (1,), generator=g))] = float(bad)
    elif bad == "inf_past_k":
        x[torch.arange(3, 3 + 50 * 101, 101)] = float("inf")
        x[n - 1] = float("nan")
    elif bad == "zeros":
        x = torch.zeros(n, dtype=dtype).index_fill_(0, torch.arange(0, n, 1000), 2.0)
    sel = TopK(k=10 if bad == "inf_past_k" else n // 100)
    selected, covering, finite = sel.select_checked(x)
    want, want_cov = sel.select_covering(x)
    assert torch.equal(selected.indices, want.indices) and covering == want_cov
    assert torch.equal(selected.values.view(torch.uint8), want.values.view(torch.uint8))
    if bad == "zeros":
        assert finite is None and covering
    else:
        assert finite is (bad == "none"), (bad, finite)  # the one pass answered


def test_the_threshold_scan_covers_every_chunk() -> None:
    """The compiled scan runs chunk by chunk (``CHUNK`` entries, the positions'
    buffer): every position, in order, none twice, against torch's mask, for
    selections of a few entries to all of them, and none for a threshold no entry
    reaches; a strided input too."""
    from sparcml.compress._kernels import CHUNK
    from sparcml.compress.selection import select_above

    n = 3 * CHUNK + 11
    x = torch.randn(2 * n, generator=torch.Generator().manual_seed(2))
    for y in (x[:n], x[::2]):
        for t in (0.0, 0.5, 3.0, float("inf")):
            want = (y.abs() > t).nonzero().flatten()
            assert torch.equal(select_above(y, t), want), t
            assert torch.equal(select_above(y, t, strict=False), (y.abs() >= t).nonzero().flatten())
        assert select_above(y, 0.0).numel() == n  # (every chunk's positions)


@pytest.mark.parametrize(
    ("name", "params", "scale"),
    [
        ("qsgd", {"bucket": 4, "bits": 4}, 1e-29),
        ("qsgd", {"bucket": 4, "bits": 4}, 1e-31),
        ("qsgd", {"bucket": 4, "bits": 4, "norm": "max"}, 1e-31),
        ("qsgd", {"bucket": 4, "bits": 4}, 1e19),
        ("dithering", {}, 1e-40),
        ("dithering", {}, 1e38),
        ("natural_dithering", {}, 1e38),
    ],
)
def test_quantizers_stay_finite_and_unbiased_at_float32s_ends(
    name: str, params: dict, scale: float
) -> None:
    """Norms computed in float32 underflowed (QSGD: a bucket of 1e-29 decoded as
    zeros) or overflowed (QSGD near 1e19, dithering near 3e38: finite input decoded
    as NaN), and an inverse norm overflowed (dithering near 1e-40)."""
    op = C.get(name, seed=0, **params)
    x = torch.tensor([1.0, -0.5, 0.0, 0.25]) * scale
    draws = torch.stack(
        [op.dequantize(op.quantize(x), torch.float32, x.device) for _ in range(2000)]
    ).double()
    assert bool(torch.isfinite(draws).all())
    err = (draws.mean(0) - x.double()).abs().max() / (abs(scale) * 1.0)
    assert float(err) < 0.05  # each entry's draws spread within +-scale: 4 sigma of 2000


def test_qsgd_refuses_a_scale_its_levels_cannot_decode() -> None:
    op = C.get("qsgd", bucket=4, bits=4, seed=0)
    with pytest.raises(ValueError, match="exceeds float32's largest value"):
        op.quantize(torch.tensor([3e38, -3e38, 1.0, 0.0]))


@pytest.mark.parametrize(
    ("x", "k", "want"),
    [
        (torch.ones(1), 1, 1),  # k = n: d = 1 gives t = 0, and |x - mu| > 0 kept nothing
        (torch.ones(1000), 10, 10),  # constant: no entry beyond the mean
        (torch.tensor([0.5, -0.5] * 500), 10, 10),  # two values: the fit kept none
        (torch.zeros(1000), 10, 0),  # nothing to send
        (torch.tensor([0.5] * 3 + [1.5] + [0.5] * 3 + [-0.5] + [0.5] * 992), 100, 100),
    ],
)
def test_gaussiank_sends_from_a_vector_its_fit_does_not_describe(
    x: torch.Tensor, k: int, want: int
) -> None:
    """Gaussian-k selected 0 of k entries where the values do not look Gaussian: a
    non-zero accumulator under error feedback never sent. Now the k largest
    magnitudes (exact, ties by position) when the fit keeps fewer than k/2."""
    out = C.get("gaussiank", k=k).select(x)
    assert out.nnz == want
    if want:
        assert torch.equal(out.values, x[out.indices]) and bool((out.values != 0).all())


def test_one_bit_packing_takes_an_unaligned_view_of_uint8_flags() -> None:
    """uint8 flags are not copied by ``.to(uint8)``: a view at an odd byte offset with
    a whole number of words failed to be read as int64 words."""
    flags = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1] * 3, dtype=torch.uint8)
    view = torch.cat([torch.zeros(1, dtype=torch.uint8), flags])[1:]  # offset 1
    assert torch.equal(unpack_bits(pack_bits(view, 1), 24, 1), flags.to(torch.int32))


def test_randomk_draws_a_uniform_subset_without_a_permutation_of_n() -> None:
    """Random-k drew ``randperm(n)`` every call (O(n) time and memory for k entries);
    its positions now come from draws with replacement, deduplicated, then k of the
    distinct ones: still every k-subset equally likely (each position with
    frequency k/n, each pair k(k-1)/(n(n-1)))."""
    from sparcml.compress.randomk import uniform_subset

    g = torch.Generator().manual_seed(0)
    for n, k in ((0, 0), (1, 0), (1, 1), (7, 7), (7, 3), (1 << 20, 1000)):
        s = uniform_subset(n, k, g)
        assert s.numel() == k and s.unique().numel() == k
        assert k == 0 or (int(s.min()) >= 0 and int(s.max()) < n)
    trials, n, k = 20000, 10, 3
    single = torch.zeros(n)
    pair = torch.zeros(n, n)
    for _ in range(trials):
        s = uniform_subset(n, k, g)
        single[s] += 1
        pair[s[:, None], s[None, :]] += 1
    p = k / n  # 0.3 each: binomial sd sqrt(p(1-p)/trials) = 0.0032
    assert float((single / trials - p).abs().max()) < 5 * math.sqrt(p * (1 - p) / trials)
    q = k * (k - 1) / (n * (n - 1))
    off = pair[~torch.eye(n, dtype=torch.bool)] / trials
    assert float((off - q).abs().max()) < 5 * math.sqrt(q * (1 - q) / trials)


def test_natural_decoding_to_float16_saturates_instead_of_inf() -> None:
    """float16 values above 2^15 round to 2^16 (their unbiased natural rounding), which
    is Inf in float16: 83% of 60,000s decoded as Inf. Saturated at 65504 now (a bias of
    at most 32 on such entries). (The 8-bit format's range ends at 2^13: clipped and
    counted, as documented.)"""
    op = C.get("natural", seed=0)
    x = torch.full((10000,), 60000.0, dtype=torch.float16)
    out = op.dequantize(op.quantize(x), torch.float16, x.device)
    assert bool(torch.isfinite(out).all())
    assert abs(float(out.double().mean()) - 60000.0) < 0.01 * 60000.0
