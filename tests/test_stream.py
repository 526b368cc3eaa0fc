"""SparseStream: representation, dense switch, summation cases, split/concat."""

from __future__ import annotations

import pytest
import torch

from sparcml import SparseStream
from sparcml.stream import SUPPORTED_DTYPES, dense_threshold, index_bytes


def test_index_bytes_and_threshold_follow_sec_5_1() -> None:
    # c = ceil(log2(N) / 8): the fewest bytes that hold every index below N
    assert [index_bytes(n) for n in (0, 1, 2, 256, 257)] == [1, 1, 1, 1, 2]
    assert index_bytes(65_536) == 2 and index_bytes(65_537) == 3
    assert index_bytes(1 << 24) == 3 and index_bytes((1 << 24) + 1) == 4
    assert index_bytes(1 << 32) == 4 and index_bytes((1 << 32) + 1) == 5
    assert index_bytes(1 << 63) == 8
    for c in range(1, 9):
        assert index_bytes(256**c) == c and index_bytes(256**c + 1) == min(c + 1, 9)
    # delta = N * isize / (c + isize)
    assert dense_threshold(1000, torch.float32) == 1000 * 4 // (2 + 4)
    assert dense_threshold(1 << 24, torch.float32) == (1 << 24) * 4 // 7
    assert dense_threshold(1000, torch.float64) == 1000 * 8 // 10
    assert dense_threshold(1000, torch.float16) == 1000 * 2 // 4


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_roundtrip_dense_sparse(dtype: torch.dtype) -> None:
    x = torch.zeros(50, dtype=dtype)
    x[[3, 7, 49]] = torch.tensor([1.0, -2.0, 3.0], dtype=dtype)
    s = SparseStream.from_dense(x)
    assert not s.is_dense and s.nnz == 3 and s.size == 50
    assert s.indices.tolist() == [3, 7, 49]
    assert s.dtype == dtype and s.device == torch.device("cpu")
    assert torch.equal(s.to_dense(), x)


def test_switches_to_dense_past_delta() -> None:
    n = 30
    delta = dense_threshold(n, torch.float32)  # 20
    s = SparseStream(torch.arange(delta), torch.ones(delta), n)
    assert not s.is_dense
    s2 = SparseStream(torch.arange(delta + 1), torch.ones(delta + 1), n)
    assert s2.is_dense and s2.nnz == n
    assert s2.to_dense()[: delta + 1].eq(1).all() and s2.to_dense()[delta + 1 :].eq(0).all()
    assert SparseStream.from_dense(torch.ones(n)).is_dense


def test_unsorted_and_duplicates_are_sorted_and_summed() -> None:
    s = SparseStream(torch.tensor([5, 1, 5, 3, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), 10)
    assert s.indices.tolist() == [1, 3, 5]
    assert s.values.tolist() == [7.0, 4.0, 4.0]


def test_nan_inf_are_kept() -> None:
    x = torch.tensor([0.0, float("nan"), 0.0, float("inf")])
    s = SparseStream.from_dense(x)
    assert s.indices.tolist() == [1, 3]
    y = (s + s).to_dense()
    assert torch.isnan(y[1]) and y[3] == float("inf")


@pytest.mark.parametrize(
    ("indices", "values", "size", "error", "match"),
    [
        ([0, 10], [1.0, 2.0], 10, ValueError, "index 10 out of range"),
        ([-1], [1.0], 10, ValueError, "index -1 out of range"),
        ([0, 1], [1.0], 10, ValueError, "differ in length"),
        ([0.0], [1.0], 10, TypeError, "integer"),
        ([0], [1], 10, TypeError, "unsupported value dtype"),
        ([0], [1.0], -1, ValueError, "non-negative"),
    ],
)
def test_bad_input_is_rejected(indices, values, size, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        SparseStream(torch.tensor(indices), torch.tensor(values), size)


def test_two_dimensional_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="1-D"):
        SparseStream(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="flatten"):
        SparseStream.from_dense(torch.zeros(2, 2))


def _dense_of(n: int, pairs: dict[int, float]) -> torch.Tensor:
    x = torch.zeros(n)
    for i, v in pairs.items():
        x[i] = v
    return x


def test_sum_sparse_sparse_overlapping_stays_sparse() -> None:
    a = SparseStream(torch.tensor([1, 4, 7]), torch.tensor([1.0, 2.0, 3.0]), 100)
    b = SparseStream(torch.tensor([4, 9]), torch.tensor([10.0, 20.0]), 100)
    c = a + b
    assert not c.is_dense
    assert c.indices.tolist() == [1, 4, 7, 9]
    assert c.values.tolist() == [1.0, 12.0, 3.0, 20.0]


def test_sum_sparse_sparse_switches_on_upper_bound() -> None:
    # |H1| + |H2| > delta switches to dense even though the union is small (sec. 5.1).
    n = 30
    delta = dense_threshold(n, torch.float32)
    idx = torch.arange(delta // 2 + 1)
    a = SparseStream(idx, torch.ones(idx.numel()), n)
    c = a + a
    assert c.is_dense
    assert torch.equal(c.to_dense(), 2 * a.to_dense())


def test_sum_sparse_dense_and_dense_dense_in_place() -> None:
    n = 8
    d = SparseStream.dense(torch.arange(n, dtype=torch.float32))
    s = SparseStream(torch.tensor([0, 5]), torch.tensor([10.0, 10.0]), n)
    assert torch.equal((s + d).to_dense(), (d + s).to_dense())
    storage = d.values
    d.add_(s)
    assert d.values is storage
    assert d.to_dense().tolist() == [10.0, 1, 2, 3, 4, 15, 6, 7]
    d.add_(SparseStream.dense(torch.ones(n)))
    assert d.values is storage and d.to_dense()[1] == 2.0


def test_sum_checks_compatibility() -> None:
    a = SparseStream.empty(10)
    with pytest.raises(ValueError, match="sizes 10 and 11"):
        a + SparseStream.empty(11)
    with pytest.raises(TypeError, match="dtypes"):
        a + SparseStream.empty(10, torch.float64)


def test_split_and_concat_are_inverse() -> None:
    g = torch.Generator().manual_seed(0)
    n = 97
    idx = torch.randperm(n, generator=g)[:20]
    s = SparseStream(idx, torch.randn(20, generator=g), n)
    bounds = [0, 10, 10, 50, 97]
    parts = s.split(bounds)
    assert [p.size for p in parts] == [10, 0, 40, 47]
    assert sum(p.nnz for p in parts) == 20
    assert all(int(p.indices.max()) < p.size for p in parts if p.nnz)
    back = SparseStream.concat(parts)
    assert back.equal(s)
    dense_parts = SparseStream.dense(s.to_dense()).split(bounds)
    assert torch.equal(SparseStream.concat(dense_parts).to_dense(), s.to_dense())
    # a dense stream's parts: sparse where their non-zeros are few (20 of 97 here),
    # or, with sparsify=False, dense views of its storage (no copy)
    assert not any(p.is_dense for p in dense_parts if p.size)
    whole = SparseStream.dense(s.to_dense())
    views = whole.split(bounds, sparsify=False)
    assert all(p.is_dense for p in views) and [p.size for p in views] == [10, 0, 40, 47]
    assert views[2].values.data_ptr() == whole.values[10:].data_ptr()
    full = SparseStream.dense(torch.arange(1.0, 98.0)).split(bounds)
    assert all(p.is_dense for p in full if p.size)
    with pytest.raises(ValueError, match="start at 0"):
        s.split([1, 97])
    with pytest.raises(ValueError, match="non-decreasing"):
        s.split([0, 50, 40, 97])


def test_sum_of_many_is_left_to_right() -> None:
    streams = [
        SparseStream(torch.tensor([i % 5, 7]), torch.tensor([1.0, 0.5]), 10) for i in range(6)
    ]
    total = SparseStream.sum(streams)
    expected = torch.stack([s.to_dense() for s in streams]).sum(0)
    assert torch.equal(total.to_dense(), expected)
    with pytest.raises(ValueError):
        SparseStream.sum([])


def test_equal_is_bitwise() -> None:
    a = SparseStream(torch.tensor([1]), torch.tensor([float("nan")]), 4)
    assert a.equal(a.clone())
    b = SparseStream(torch.tensor([1]), torch.tensor([-0.0]), 4)
    c = SparseStream(torch.tensor([1]), torch.tensor([0.0]), 4)
    assert not b.equal(c)


@pytest.mark.parametrize("width", [4, 1, (2, 1)])  # 1: a linear model's EmbeddingBag(F, 1)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_torch_sparse_round_trip_of_an_embedding_gradient(
    dtype: torch.dtype, width: int | tuple[int, int]
) -> None:
    if isinstance(width, tuple):  # trailing dimensions (2, 1): a sparse tensor built by hand
        g = torch.sparse_coo_tensor(
            [[3, 17]], torch.ones(2, *width, dtype=dtype), (50, *width), check_invariants=True
        )
        s = SparseStream.from_torch_sparse(g)
        back = s.to_torch_sparse(g.shape, sparse_dim=1)
        assert back.is_coalesced() and torch.equal(back.to_dense(), g.to_dense())
        return
    emb = torch.nn.Embedding(50, width, sparse=True).to(dtype)
    emb(torch.tensor([[3, 17, 3], [40, 0, 17]])).float().sum().backward()
    g = emb.weight.grad
    assert g.layout == torch.sparse_coo
    s = SparseStream.from_torch_sparse(g)
    assert s.size == 50 * width and not s.is_dense
    assert torch.equal(s.to_dense(), g.to_dense().reshape(-1))  # duplicates (row 3, 17) summed
    back = s.to_torch_sparse(g.shape, sparse_dim=1)
    assert back.is_coalesced() and torch.equal(back.to_dense(), g.to_dense())
    assert torch.equal(back.indices(), g.coalesce().indices())


def test_torch_sparse_any_layout_and_dense_streams() -> None:
    t = torch.sparse_coo_tensor([[0, 2, 2], [1, 0, 3]], torch.tensor([1.0, 2.0, 3.0]), (3, 4))
    s = SparseStream.from_torch_sparse(t)
    assert s.indices.tolist() == [1, 8, 11]
    assert torch.equal(s.to_torch_sparse((3, 4)).to_dense(), t.to_dense())
    d = SparseStream.dense(torch.arange(6.0))
    assert torch.equal(
        d.to_torch_sparse((2, 3), sparse_dim=1).to_dense(), torch.arange(6.0).reshape(2, 3)
    )
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 5), (7, 5))
    e = SparseStream.from_torch_sparse(empty)
    assert e.nnz == 0 and e.size == 35
    assert e.to_torch_sparse((7, 5), sparse_dim=1).to_dense().abs().sum() == 0
    with pytest.raises(TypeError, match="sparse COO"):
        SparseStream.from_torch_sparse(torch.ones(3))
    with pytest.raises(ValueError, match="does not hold"):
        s.to_torch_sparse((5, 5))


@pytest.mark.parametrize(
    ("shape", "sparse_dim"),
    [((7,), 1), ((4, 3), 1), ((4, 3), 2), ((3, 4, 5), 1), ((3, 4, 5), 2), ((3, 4, 5), 3),
     ((6, 1), 1), ((6, 1), 2), ((5, 0), 1), ((0, 3), 1), ((0,), 1), ((1 << 33, 1), 1)],
)  # fmt: skip
def test_torch_sparse_round_trip_of_every_layout(shape: tuple[int, ...], sparse_dim: int) -> None:
    """Every sparse/dense split of COO tensors, zero-sized and zero-wide ones (an
    ``Embedding(n, 0)``'s gradient) and rows beyond 2^32 included: the stream holds
    the row-major entries, and converting back gives the same coalesced tensor (a
    single sparse dimension's coordinates are the offsets themselves, the first
    coordinate needs no remainder)."""
    g = torch.Generator().manual_seed(sum(shape) + sparse_dim)
    if shape[0] == 1 << 33:  # (too large to densify: three rows near the ends)
        rows = torch.tensor([[0, 5, (1 << 33) - 1]])
        t = torch.sparse_coo_tensor(rows, torch.tensor([[1.0], [-2.0], [3.0]]), shape).coalesce()
        s = SparseStream.from_torch_sparse(t)
        assert s.indices.tolist() == [0, 5, (1 << 33) - 1] and s.size == 1 << 33
        back = s.to_torch_sparse(shape, sparse_dim=1)
        assert torch.equal(back.indices(), t.indices()) and torch.equal(back.values(), t.values())
        return
    dense = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.15)
    t = dense.to_sparse(sparse_dim)
    s = SparseStream.from_torch_sparse(t)
    assert s.size == dense.numel() and torch.equal(s.to_dense(), dense.reshape(-1))
    back = s.to_torch_sparse(shape, sparse_dim=sparse_dim)
    assert back.is_coalesced() and back.sparse_dim() == sparse_dim
    assert torch.equal(back.to_dense(), dense)
    if not s.is_dense:  # (a stream past SparCML's delta is dense: every row comes back)
        assert torch.equal(back.indices(), t.indices())
    # the same entries stored twice and out of order: read summed, as coalesce sums
    twice = torch.sparse_coo_tensor(
        torch.cat([t.indices(), t.indices()], 1).flip(1),
        torch.cat([t.values(), t.values()]).flip(0),
        shape,
    )
    assert torch.equal(SparseStream.from_torch_sparse(twice).to_dense(), 2 * dense.reshape(-1))


@pytest.mark.parametrize("stored", [0, 1])
def test_torch_sparse_without_a_sparse_dimension(stored: int) -> None:
    """A COO tensor with no sparse dimension holds the whole tensor as one entry, or
    nothing: the stream is that tensor, or empty (it used to claim one index for an
    empty tensor)."""
    values = torch.arange(1.0, 7.0).reshape(1, 3, 2)[:stored]
    t = torch.sparse_coo_tensor(torch.zeros(0, stored, dtype=torch.int64), values, (3, 2))
    s = SparseStream.from_torch_sparse(t)
    assert s.size == 6 and torch.equal(s.to_dense(), t.to_dense().reshape(-1))
    assert s.nnz == 6 * stored


@pytest.mark.parametrize("span", [40, 2_000, 1 << 20, 1 << 40])
@pytest.mark.parametrize("runs", [2, 3, 8, 11])
def test_merge_positions_match_a_sort(span: int, runs: int) -> None:
    """Every merge kernel (two runs, the bitmap of a narrow span, the k-way merge of a
    wide one) gives the sorted union and each input's place in it, as a sort does."""
    from sparcml.merge import merge_positions

    g = torch.Generator().manual_seed(span + runs)
    base = 1 << 33  # positions beyond 2^32, span narrow or wide
    parts = []
    for r in range(runs):
        n = 0 if r == 1 else int(torch.randint(1, 300, (1,), generator=g))
        picks = torch.randint(0, span, (n,), generator=g, dtype=torch.int64)
        parts.append(torch.unique(picks) + base)
    union, pos = merge_positions(parts)
    cat = torch.cat(parts)
    ref = torch.unique(cat)
    assert torch.equal(union, ref)
    assert torch.equal(union[pos], cat)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("sizes", [(0, 0), (0, 40), (40, 0), (1, 1), (300, 250), (2_000, 1_999)])
def test_merge_sum_of_two_runs_is_the_run_ordered_index_add(
    dtype: torch.dtype, sizes: tuple[int, int]
) -> None:
    """Two runs merged and added in one compiled pass (float32/float64 on the CPU)
    give the bits of the positions-and-``index_add_`` path every other case takes:
    ``-0.0 + a``, ``(-0.0 + a) + b``; signed zeros, NaN and infinities included,
    indices beyond 2^32, runs overlapping in part, and empty runs."""
    from sparcml.merge import merge_positions, merge_sum

    g = torch.Generator().manual_seed(sum(sizes))
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40])
    runs, vals = [], []
    for n in sizes:
        runs.append(torch.randperm(3 * max(sizes) + 1, generator=g)[:n].sort().values + (1 << 33))
        v = torch.randn(n, generator=g, dtype=torch.float64)
        hit = torch.randint(0, 3, (n,), generator=g) == 0  # a third of them special
        v[hit] = special[torch.randint(0, 6, (int(hit.sum()),), generator=g)].double()
        vals.append(v.to(dtype))
    union, pos = merge_positions(runs)
    ref = torch.full((union.numel(),), -0.0, dtype=dtype)
    ref.index_add_(0, pos[: sizes[0]], vals[0]).index_add_(0, pos[sizes[0] :], vals[1])
    got_i, got_v = merge_sum(runs, vals)
    assert torch.equal(got_i, union)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    assert torch.equal(got_v.view(bits), ref.view(bits))
    # strided inputs: a view every other entry, against the two-pass path on them
    half = [r[::2] for r in runs], [v[::2] for v in vals]
    union, pos = merge_positions(half[0])
    ref = torch.full((union.numel(),), -0.0, dtype=dtype)
    first = half[0][0].numel()
    ref.index_add_(0, pos[:first], half[1][0]).index_add_(0, pos[first:], half[1][1])
    got_i, got_v = merge_sum(*half)
    assert torch.equal(got_i, union) and torch.equal(got_v.view(bits), ref.view(bits))


def test_from_sorted_widens_narrower_indices() -> None:
    """``from_sorted`` holds its indices as int64, as the constructor does: pairs given
    with int32 or int16 indices densify, subtract and merge like int64 ones (the
    index_copy_ / index_select paths take int64 only)."""
    from sparcml.sgd.feedback import ErrorFeedback

    values = torch.tensor([2.0, -3.0, 0.5])
    want = torch.zeros(1000).index_put_((torch.tensor([1, 4, 9]),), values)
    for dtype in (torch.int16, torch.int32, torch.int64):
        s = SparseStream.from_sorted(torch.tensor([1, 4, 9], dtype=dtype), values, 1000)
        assert not s.is_dense and s.indices.dtype == torch.int64
        assert torch.equal(s.to_dense(), want)
        fb = ErrorFeedback()
        acc = torch.arange(1000, dtype=torch.float32)
        fb.update(acc, s, "w")
        assert torch.equal(fb.buffers["w"], acc - want)


_CACHE_PROBE = """
from sparcml import cpu_kernels as k
from sparcml.compress.warmup import warm_kernels
warm_kernels()
names = k.__all__  # every compiled kernel
print({n: (sum(getattr(k, n).stats.cache_hits.values()),
           sum(getattr(k, n).stats.cache_misses.values())) for n in names})
"""


def test_compiled_kernels_are_found_in_the_disk_cache_by_the_next_process(tmp_path) -> None:
    """The first process compiles every kernel warm_kernels() touches; the next one
    loads all of them from numba's cache and compiles none (kernels that close over
    their constants were compiled anew by every process: 0.8 s inside a collective)."""
    import ast
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [
        ast.literal_eval(
            subprocess.run(
                [sys.executable, "-c", _CACHE_PROBE], env=env, check=True,
                capture_output=True, text=True, timeout=300,
            ).stdout.strip().splitlines()[-1]
        )
        for _ in range(2)
    ]  # fmt: skip
    first, second = runs
    assert all(misses > 0 for _, misses in first.values()), first
    assert all(hits > 0 and misses == 0 for hits, misses in second.values()), second


@pytest.mark.parametrize("c", range(1, 9))
def test_widen_increasing_checks_in_the_same_pass(c: int) -> None:
    from sparcml.reinterpret import index_low_bytes, indices_from_low_bytes
    from sparcml.wire import widen_increasing

    size = min(256**c, 1 << 62) - 3  # the top byte of the widest index in use
    idx = torch.tensor([0, 7, 9, size - 1], dtype=torch.int64)
    words = index_low_bytes(idx, c)
    assert words.numel() == 4 * c
    # the compiled narrowing on CPU writes the bytes torch's copy writes, at any offset
    from sparcml.wire import write_index_field

    for start in (0, 1):
        field = torch.full((start + 4 * c,), 0xAB, dtype=torch.uint8)
        write_index_field(field[start:], idx, c)
        assert torch.equal(field[start:], words) and (field[:start] == 0xAB).all()
    # the torch ops of the CUDA path read the same fields
    assert torch.equal(indices_from_low_bytes(words, c), idx)
    assert torch.equal(indices_from_low_bytes(torch.cat([words[:1], words])[1:], c), idx)
    out = torch.empty(4, dtype=torch.int64)
    assert widen_increasing(words, c, size, out, offset=5) == -1
    assert torch.equal(out, idx + 5)
    assert widen_increasing(words, c, size - 1, out) == 4  # last one out of range
    bad = idx.clone()
    bad[2] = 7
    assert widen_increasing(index_low_bytes(bad, c), c, size, out) == 2  # repeated
    bad[2] = 3
    assert widen_increasing(index_low_bytes(bad, c), c, size, out) == 2  # decreasing
    assert widen_increasing(words[:0], c, size, out[:0]) == -1
    if c == 8:
        neg = torch.tensor([-3, 1], dtype=torch.int64)
        assert widen_increasing(index_low_bytes(neg, 8), 8, size, out[:2]) == 0


@pytest.mark.parametrize("size", [4.5, 4.0, "4", None])
def test_a_size_that_is_not_an_integer_is_refused(size: object) -> None:
    """Issue 34: SparseStream(idx, vals, 4.5) was taken as N = 4."""
    with pytest.raises(TypeError, match="size must be an integer"):
        SparseStream(torch.tensor([1]), torch.tensor([1.0]), size)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="size must be an integer"):
        SparseStream.empty(size)  # type: ignore[arg-type]


def test_integer_sizes_of_any_integer_type_are_taken() -> None:
    import numpy as np

    for size in (5, np.int64(5), torch.tensor(5)):
        assert SparseStream(torch.tensor([1]), torch.tensor([1.0]), size).size == 5  # type: ignore[arg-type]


def test_values_that_require_grad_are_refused_with_the_fix_named() -> None:
    w = torch.ones(4, requires_grad=True)
    for build in (
        lambda: SparseStream(torch.tensor([0, 2]), w[:2], 4),
        lambda: SparseStream.dense(w),
        lambda: SparseStream.from_dense(w),
    ):
        with pytest.raises(ValueError, match=r"require grad.*detach\(\)"):
            build()
    assert SparseStream.dense(w.detach()).size == 4


@pytest.mark.parametrize("algorithm", ["dsar_split_allgather", "dense"])
def test_a_dense_result_that_cannot_exist_is_refused_before_any_message(algorithm: str) -> None:
    """Issue 34: dsar_split_allgather with N = 2^40 tried to allocate 1.4 TB and failed
    with a raw RuntimeError; now ValueError naming N and the bytes, on every rank,
    before anything is sent. A sparse algorithm takes the same N."""
    from sparcml import sparse_allreduce
    from sparcml.comm import run_ranks

    n = 1 << 40

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank, n - 1]), torch.tensor([1.0, 2.0]), n)
        with pytest.raises(ValueError, match=r"N = 1,099,511,627,776 .* 4,398,046,511,104 bytes"):
            sparse_allreduce(s, comm, algorithm=algorithm)
        sent = comm.stats.messages_sent
        out = sparse_allreduce(s, comm, algorithm="ssar_recursive_double")
        return sent, out.nnz, float(out.values[-1])

    for sent, nnz, last in run_ranks(3, fn):
        assert sent == 0 and nnz == 4 and last == 6.0


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_nonzero_scans_match_torch(dtype: torch.dtype) -> None:
    """sparcml.nonzero's compiled passes against torch's nonzero, count_nonzero and
    boolean masks: -0.0 and +0.0 dropped, NaN and Inf kept, subnormals kept, every
    position of a zero (first, last, runs), strided and empty inputs; no copy when
    no value is zero."""
    from sparcml.nonzero import count_nonzero, drop_zeros, nonzero_positions
    from sparcml.reinterpret import as_bytes

    g = torch.Generator().manual_seed(11)
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal of the dtype
    for n in (0, 1, 2, 9, 1000):
        x = torch.randn(n, generator=g).to(dtype)
        if n:
            mask = torch.rand(n, generator=g) < 0.3
            x[mask] = 0.0
            x[torch.rand(n, generator=g) < 0.1] = -0.0
            specials = [float("nan"), float("inf"), float("-inf"), tiny, -0.0, 0.0]
            where = torch.randint(0, n, (6,), generator=g).tolist()
            for at, v in zip(where, specials, strict=True):
                x[at] = v
            x[0], x[-1] = 0.0, -0.0
        idx = torch.arange(5, 5 + 3 * n, 3)
        for view, ids in ((x, idx), (x[::2], idx[::2]), (x.flip(0), idx)):
            want = torch.nonzero(view).flatten()
            assert torch.equal(nonzero_positions(view), want)
            assert count_nonzero(view) == int(torch.count_nonzero(view))
            got_i, got_v = drop_zeros(ids, view)
            keep = view != 0
            assert torch.equal(got_i, ids[keep])
            assert torch.equal(as_bytes(got_v), as_bytes(view[keep]))
    y = torch.randn(50, generator=g).to(dtype)
    ids = torch.arange(50)
    got_i, got_v = drop_zeros(ids, y)
    assert got_i is ids and got_v is y  # none is zero: the same tensors
    assert count_nonzero(y.reshape(5, 10)) == 50
    z = torch.zeros(7, dtype=dtype)
    assert nonzero_positions(z).numel() == 0 and drop_zeros(torch.arange(7), z)[0].numel() == 0
    with pytest.raises(ValueError, match="2 indices for 4 values"):  # (never read past them)
        drop_zeros(torch.arange(2), torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=dtype))
    narrow = torch.arange(3, dtype=torch.int32)  # another index dtype keeps its dtype
    got_i, _ = drop_zeros(narrow, torch.tensor([1.0, 0.0, 2.0], dtype=dtype))
    assert got_i.dtype == torch.int32 and got_i.tolist() == [0, 2]


def test_from_dense_takes_the_compiled_positions() -> None:
    """from_dense (and split's sparsified pieces) keep what torch.nonzero keeps, values
    bit for bit; a stated count that is wrong is refused, not written past."""
    from sparcml.nonzero import nonzero_positions

    g = torch.Generator().manual_seed(3)
    x = torch.zeros(1 << 16)
    at = torch.randperm(x.numel(), generator=g)[:300]
    x[at] = torch.randn(300, generator=g)
    x[at[:3]] = torch.tensor([float("nan"), -0.0, float("-inf")])
    s = SparseStream.from_dense(x)
    want = torch.nonzero(x).flatten()
    assert not s.is_dense and torch.equal(s.indices, want)
    assert torch.equal(s.values.view(torch.int32), x[want].view(torch.int32))
    with pytest.raises(ValueError, match="non-zeros given"):
        nonzero_positions(x, count=10)
