"""Error feedback, SparCML's quantized TopK SGD step, and quantized collectives."""

from __future__ import annotations

import pytest
import torch

from inputs import dense_reference, make_stream
from sparcml import ErrorFeedback, SparseStream, compress, sparse_allreduce
from sparcml.collectives.codec import StreamCodec
from sparcml.collectives.dsar_split_allgather import dsar_split_allgather
from sparcml.comm import run_ranks
from sparcml.torch import topk_sgd_step

OPERATORS = [
    ("topk", {"density": 0.05}),
    ("threshold_bsearch", {"k": 20}),
    ("natural", {}),
    ("qsgd", {"bits": 4, "bucket": 128}),
    ("natural_dithering", {}),
    ("topk+natural", {"k": 30}),
    ("topk+qsgd", {"k": 30, "bits": 2}),
    ("asq", {"k": 10}),
]


@pytest.mark.parametrize(("name", "params"), OPERATORS)
def test_invariant_original_equals_sent_plus_residual_float64(name: str, params: dict) -> None:  # type: ignore[type-arg]
    ef = ErrorFeedback()
    op = compress.get(name, **params)
    g = torch.Generator().manual_seed(0)
    storage = None
    for _step in range(5):
        grad = torch.randn(40, 25, generator=g, dtype=torch.float64)
        acc = ef.compensate(grad, "w", lr=0.1)
        payload, ctx = op.compress(acc)
        sent = op.decompress(payload, ctx)
        ef.update(acc, sent, "w")
        r = ef.residual("w")
        assert r is not None
        # exact for selectors (residual = acc off the selection, 0 on it) and for
        # natural compression (Sterbenz: C(x) within a factor 2 of x); within one
        # rounding otherwise
        assert torch.allclose(sent + r, acc, rtol=0, atol=1e-15 * float(acc.abs().max()))
        if name in ("topk", "threshold_bsearch", "natural"):
            assert torch.equal(sent + r, acc)
        if storage is None:
            storage = r.data_ptr()
        assert r.data_ptr() == storage  # one residual tensor per name, reused
    assert len(ef) == 1


def test_feedback_with_sparse_sent_and_errors() -> None:
    ef = ErrorFeedback()
    acc = ef.compensate(torch.tensor([1.0, -5.0, 2.0, 0.5]), "b")
    sel = compress.get("topk", k=2).select(acc)
    ef.update(acc, sel, "b")
    assert ef.residual("b").tolist() == [1.0, 0.0, 0.0, 0.5]
    acc2 = ef.compensate(torch.ones(4), "b")
    assert acc2.tolist() == [2.0, 1.0, 1.0, 1.5]
    with pytest.raises(ValueError, match="does not match the residual"):
        ef.compensate(torch.ones(5), "b")
    with pytest.raises(ValueError, match="sent stream of size 3"):
        ef.update(acc, SparseStream.empty(3), "b")
    state = ef.state_dict()
    ef.reset()
    assert ef.residual("b") is None
    ef.load_state_dict(state)
    assert ef.residual("b").tolist() == [1.0, 0.0, 0.0, 0.5]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_topk_sgd_step_matches_alg1_reference(world: int) -> None:
    k, lr = 15, 0.5

    def fn(comm):  # type: ignore[no-untyped-def]
        ef = ErrorFeedback()
        g = torch.Generator().manual_seed(comm.rank)
        out = []
        for _ in range(3):
            grad = torch.randn(200, generator=g)
            out.append((grad, topk_sgd_step(grad, "w", ef, comm, k=k, lr=lr)))
        return out

    res = run_ranks(world, fn)
    # Reference in one process: Alg. 1 over the ranks' gradients
    eps = [torch.zeros(200) for _ in range(world)]
    for step in range(3):
        total = torch.zeros(200, dtype=torch.float64)
        for r in range(world):
            acc = eps[r] + lr * res[r][step][0]
            top = torch.topk(acc.abs(), k).indices
            sent = torch.zeros(200)
            sent[top] = acc[top]
            eps[r] = acc - sent
            total += sent.double()
        for r in range(world):
            assert torch.allclose(res[r][step][1].double(), total, atol=1e-5)
            assert torch.equal(res[r][step][1], res[0][step][1])


def test_topk_sgd_step_with_quantizer_is_identical_on_every_rank() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        ef = ErrorFeedback()
        grad = torch.randn(500, generator=torch.Generator().manual_seed(comm.rank))
        q = compress.get("natural", seed=comm.rank)  # ranks draw differently
        return topk_sgd_step(grad, "w", ef, comm, density=0.1, quantizer=q)

    out = run_ranks(5, fn)
    assert all(torch.equal(o, out[0]) for o in out)
    with pytest.raises(ValueError, match="not both"):
        topk_sgd_step(torch.ones(3), "w", ErrorFeedback(), selector=compress.get("topk", k=1), k=1)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize(
    "algorithm", ["ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "auto"]
)
@pytest.mark.parametrize("quantize", ["dense", "all"])
def test_quantized_allreduce_identical_and_close(world: int, algorithm: str, quantize: str) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream(
            "dense" if quantize == "dense" else "overlap", comm.rank, world, 3001, integer=False
        )
        q = compress.get("qsgd", bits=8, bucket=256, seed=comm.rank)
        return s, sparse_allreduce(s, comm, algorithm=algorithm, quantizer=q, quantize=quantize)

    out = run_ranks(world, fn)
    ref = dense_reference([o[0] for o in out])
    scale = torch.stack([o[0].to_dense().abs().double() for o in out]).sum(0)
    for _, res in out:
        assert res.equal(out[0][1])
    err = out[0][1].to_dense().double() - ref
    # 8-bit QSGD, 2-norm buckets of 256: variance factor omega = min(B/s^2, sqrt(B)/s)
    # = 0.016 per quantization, i.e. ~13% relative l2 error each; a few quantizations
    # stack up along the algorithm's phases. A wrong sum is off by ~100%.
    assert float(err.norm() / ref.norm()) <= 0.25  # observed <= 0.08
    assert float(err.abs().max()) <= 0.5 * float(scale.max())


def test_dsar_quantized_dense_phase_shrinks_bytes() -> None:
    def fn(comm, codec):  # type: ignore[no-untyped-def]
        s = make_stream("dense", comm.rank, comm.world_size, 40_000, integer=False)
        comm.stats.reset()
        out = dsar_split_allgather(s, comm, codec)
        return out, comm.stats.bytes_sent

    exact = run_ranks(4, fn, StreamCodec())
    quant = run_ranks(4, fn, StreamCodec(compress.get("qsgd", bits=4)))
    # phase 2 (dense allgather) dominates: 4-bit codes + one float per 1024 -> ~1/8
    assert quant[0][1] < exact[0][1] * 0.6
    assert all(q[0].equal(quant[0][0]) for q in quant)


def test_quantizer_argument_errors() -> None:
    s = SparseStream.empty(5)
    with pytest.raises(ValueError, match="dense algorithm cannot quantize"):
        sparse_allreduce(s, algorithm="dense", quantizer="qsgd")
    with pytest.raises(TypeError, match="value quantizer"):
        sparse_allreduce(s, quantizer=compress.get("topk", k=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantize must be"):
        sparse_allreduce(s, quantizer="natural", quantize="some")


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_error_feedback_on_non_contiguous_gradients(layout: str) -> None:
    # channels_last convolutions and transposed views once raised "view size is
    # not compatible"; the invariant acc == sent + residual must hold in row-major order
    g = torch.Generator().manual_seed(3)
    if layout == "transposed":
        grad = torch.randn(8, 6, generator=g, dtype=torch.float64).t()
    else:
        grad = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64).to(
            memory_format=torch.channels_last
        )
    assert not grad.is_contiguous()
    ef = ErrorFeedback()
    for _ in range(3):
        acc = ef.compensate(grad, "w", lr=0.5)
        sel = compress.get("topk", k=5).select(acc)
        ef.update(acc, sel, "w")
        assert torch.equal(sel.to_dense().reshape(acc.shape) + ef.residual("w"), acc)
    out = topk_sgd_step(grad, "w2", ErrorFeedback(), k=5, quantizer="natural")
    assert out.shape == grad.shape and int((out != 0).sum()) == 5


def test_a_bucket_reads_residuals_of_another_dtype_as_their_values() -> None:
    """A residual loaded in another dtype (or on another device: a checkpoint read with
    ``map_location="cpu"``) is read as its values in the bucket's dtype, not replaced
    by zeros; one of another size (another parameter) is."""
    from sparcml.sgd.feedback import NamedBuffers

    buf = NamedBuffers()
    buf.load_state_dict(
        {"residuals": {"a": torch.tensor([1.5, -2.0], dtype=torch.float64), "b": torch.ones(3)}}
    )
    like = torch.zeros(6, dtype=torch.float32)
    flat = buf.gather(["a", "b"], [2, 4], like)
    assert flat.dtype == torch.float32
    assert flat.tolist() == [1.5, -2.0, 0.0, 0.0, 0.0, 0.0]


def test_topk_select_covering_says_when_every_non_zero_was_selected() -> None:
    """On the CPU, a top-k of fewer than ``k`` entries is every non-zero (NaN is one);
    ``k`` non-zeros or more, or a selector that cannot tell, say False."""
    for n in (1000, 70_000):  # torch.topk's path, and the one-pass search's
        x = torch.zeros(n)
        x[[3, 17, n - 1]] = torch.tensor([0.5, float("nan"), -2.0])
        x[5] = -0.0
        sel, covering = compress.get("topk", k=10).select_covering(x)
        assert covering and sel.indices.tolist() == [3, 17, n - 1]
        sel, covering = compress.get("topk", k=3).select_covering(x)
        assert not covering and sel.nnz == 3  # k non-zeros: not known
        x[::2] = 1.0
        assert not compress.get("topk", k=10).select_covering(x)[1]
    _, covering = compress.get("randomk", k=10, seed=0).select_covering(torch.zeros(100))
    assert not covering  # (the default: unknown)


def test_a_residual_known_zero_is_skipped_until_something_writes_it() -> None:
    """``compensate_bucket`` returns the gradient itself while the residual is known to
    be zero (no pass over it); an in-place write into a residual (a checkpoint loaded
    into the buffers), a new state or ``reset`` ends that, and the sum is read again."""
    ef = ErrorFeedback()
    names, sizes = ("a", "b"), (3, 2)
    g = torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0])
    acc = ef.compensate_bucket(names, sizes, g)
    assert acc is not g
    ef.update_bucket(names, sizes, acc, SparseStream.from_dense(acc), covering=True)
    assert ef.known_zero(names, sizes, g)
    assert ef.compensate_bucket(names, sizes, g) is g
    assert not ef.known_zero(names, sizes, g.double())  # another dtype: read it
    ef.buffers["b"].add_(1.0)  # written in place, through a view of the bucket's tensor
    assert not ef.known_zero(names, sizes, g)
    assert ef.compensate_bucket(names, sizes, g).tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]
    ef.update_bucket(names, sizes, acc.clone(), SparseStream.from_dense(acc), covering=True)
    state = ef.state_dict()
    ef.load_state_dict(state)
    assert not ef.known_zero(names, sizes, g)
    ef.update_bucket(names, sizes, acc.clone(), SparseStream.from_dense(acc), covering=True)
    ef.reset("a")
    assert not ef.known_zero(names, sizes, g)
    ef.update_bucket(names, sizes, acc.clone(), SparseStream.from_dense(acc), covering=False)
    assert not ef.known_zero(names, sizes, g)  # (not covering: never marked)
