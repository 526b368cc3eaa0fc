"""Any valid input works: every layout, size, dtype and world size, every algorithm.

Property tests over P = 1..9 and 16, N = 1..64 and a few large N (2^32 included),
every dtype, and inputs built from strided, non-contiguous, one-element and
empty views (``tensor.contiguous()`` leaves a one-element view's stride as it is,
which once crashed the wire encoding). Exact algorithms are compared with the
dense sum (integer values: exact in every dtype) and must give the same bits on
every rank; Ok-Topk is compared with its definition (local top-k by the k-th
magnitude, sum, global top-k by the k-th magnitude of the sum), k = 1 and a
single survivor included.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparcml import SparseStream, algorithms, sparse_allgather, sparse_allreduce
from sparcml.collectives import OkTopkState, oktopk_allreduce
from sparcml.comm import run_ranks
from sparcml.stream import SUPPORTED_DTYPES

# aliases: the same function; variants: a two-level one with another inner (tests/test_twolevel.py)
EXACT = [*algorithms(exact=True, aliases=False, variants=False), "auto"]
WORLDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
LAYOUTS = ("contiguous", "strided", "one_element", "transposed_row", "empty", "dense_strided")


def _view(t: torch.Tensor, layout: str, g: torch.Generator) -> torch.Tensor:
    """``t``'s values as a view of the given layout (same values, odd strides)."""
    n = t.numel()
    if layout in ("strided", "one_element", "dense_strided"):
        big = torch.zeros(3 * max(n, 1) + 2, dtype=t.dtype)
        off = int(torch.randint(0, 2, (1,), generator=g))
        big[off : off + 3 * n : 3] = t
        return big[off : off + 3 * n : 3]
    if layout == "transposed_row":  # a column of a row-major matrix: stride = columns
        m = torch.zeros(max(n, 1), 4, dtype=t.dtype)
        m[:n, 1] = t
        return m.t()[1][:n]
    return t


def _stream(layout: str, rank: int, world: int, n: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + n)
    if layout == "dense_strided":
        vals = torch.randint(-4, 5, (n,), generator=g).to(dtype)
        return SparseStream.dense(_view(vals, layout, g))
    if layout == "empty":
        k = 0
    elif layout == "one_element":
        k = min(1, n)
    else:
        k = int(torch.randint(0, n + 1, (1,), generator=g))
    if layout == "one_element":
        # the example: rank r passes torch.arange(N)[r::P][:1]
        idx = torch.arange(n)[rank % n :: world][:1]
        vals = _view(torch.randint(-4, 5, (idx.numel(),), generator=g).to(dtype), layout, g)
        return SparseStream(idx, vals, n)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    vals = torch.randint(-4, 5, (k,), generator=g).to(dtype)
    return SparseStream(_view(idx, layout, g), _view(vals, layout, g), n)


def _cases(world: int, count: int) -> list[tuple[int, torch.dtype, str]]:
    rng = random.Random(world)
    sizes = [1, 2, 3, world, world + 1, 63, 64, *rng.sample(range(4, 64), 6)]
    cases = []
    for i in range(count):
        cases.append((sizes[i % len(sizes)], SUPPORTED_DTYPES[i % 4], LAYOUTS[i % len(LAYOUTS)]))
    return cases


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algorithm", EXACT)
def test_every_layout_size_and_dtype_is_exact_and_identical(world: int, algorithm: str) -> None:
    for seed, (n, dtype, layout) in enumerate(_cases(world, 12)):

        def fn(comm, n=n, dtype=dtype, layout=layout, seed=seed):  # type: ignore[no-untyped-def]
            s = _stream(layout, comm.rank, world, n, dtype, seed)
            return s, sparse_allreduce(s, comm, algorithm=algorithm)

        out = run_ranks(world, fn)
        ref = torch.stack([s.to_dense().to(torch.float64) for s, _ in out]).sum(0)
        first = out[0][1]
        for r, (_, res) in enumerate(out):
            assert res.equal(first), (algorithm, n, dtype, layout, f"rank {r} differs")
        assert torch.equal(first.to_dense().to(torch.float64), ref), (algorithm, n, dtype, layout)


# (dense and dsar_split_allgather materialise N-long dense vectors by design)
SPARSE_PATHS = [a for a in EXACT if a not in ("dense", "dsar_split_allgather")]


@pytest.mark.parametrize("algorithm", [*SPARSE_PATHS, "sparse_allgather"])
def test_indices_beyond_2_to_the_32(algorithm: str) -> None:
    # 8-byte indices behind 24-byte headers: records at offsets not divisible by 8
    n = 2**32 + 5

    def fn(comm):  # type: ignore[no-untyped-def]
        idx = torch.tensor([2**32 + comm.rank, 7 * comm.rank])
        s = SparseStream(idx, torch.tensor([1.0, 2.0]), n)
        if algorithm == "sparse_allgather":
            return [(x.indices.tolist(), x.values.tolist()) for x in sparse_allgather(s, comm)]
        r = sparse_allreduce(s, comm, algorithm=algorithm)
        return r.indices.tolist(), r.values.tolist()

    out = run_ranks(2, fn)
    if algorithm == "sparse_allgather":
        assert out[0] == out[1] == [([0, 2**32], [2.0, 1.0]), ([7, 2**32 + 1], [2.0, 1.0])]
    else:
        assert out[0] == out[1] == ([0, 7, 2**32, 2**32 + 1], [2.0, 2.0, 1.0, 1.0])


def _oktopk_reference(accs: list[torch.Tensor], k: int) -> torch.Tensor:
    """Ok-Topk's definition on float64 copies: local >= k-th magnitude, sum, global."""
    total = torch.zeros(accs[0].numel(), dtype=torch.float64)
    support = torch.zeros(accs[0].numel(), dtype=torch.bool)
    for a in accs:
        a = a.to(torch.float64)
        t = a.abs().topk(k).values.min()
        sel = a.abs() > 0 if t == 0 else a.abs() >= t
        total += torch.where(sel, a, torch.zeros_like(a))
        support |= sel
    mags = total.abs()[support]
    t = mags.topk(k).values.min() if mags.numel() >= k else torch.tensor(0.0)
    keep = support & ((total.abs() > 0) if t == 0 else (total.abs() >= t))
    return torch.where(keep, total, torch.zeros_like(total))


@pytest.mark.parametrize("world", WORLDS)
def test_oktopk_matches_its_definition(world: int) -> None:
    rng = random.Random(world)
    for case in range(8):
        n = rng.choice([1, 2, 3, 4, 5, world, 17, 64])
        k = rng.choice([1, 1, 2, n])
        k = min(k, n)
        dtype = SUPPORTED_DTYPES[case % 4]
        layout = ("contiguous", "strided", "transposed_row")[case % 3]

        def fn(comm, n=n, k=k, dtype=dtype, layout=layout, case=case):  # type: ignore[no-untyped-def]
            g = torch.Generator().manual_seed(case * 101 + comm.rank)
            # distinct magnitudes per rank (no ties), a few zeros
            acc = (torch.randperm(n, generator=g) - n // 3).to(dtype)
            acc = _view(acc, layout, g)
            return acc.clone(), oktopk_allreduce(acc, k, comm, OkTopkState()).stream

        out = run_ranks(world, fn)
        ref = _oktopk_reference([a for a, _ in out], k)
        for r, (_, res) in enumerate(out):
            assert res.equal(out[0][1]), f"rank {r} differs (n={n}, k={k}, {dtype})"
        got = out[0][1].to_dense().to(torch.float64)
        assert torch.equal(got, ref), (world, n, k, dtype, layout)


@pytest.mark.parametrize(("world", "n"), [(2, 4), (5, 3), (3, 64), (16, 16)])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_oktopk_single_survivor(world: int, n: int, dtype: torch.dtype) -> None:
    # k = 1, one non-zero per rank: exactly one entry survives the global selection
    def fn(comm):  # type: ignore[no-untyped-def]
        acc = torch.zeros(n, dtype=dtype)
        acc[comm.rank % n] = 1.0 + comm.rank
        return oktopk_allreduce(acc, 1, comm, OkTopkState()).stream

    out = run_ranks(world, fn)
    sums = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        sums[r % n] += 1.0 + r
    want = torch.zeros(n, dtype=torch.float64)
    top = int(sums.argmax())
    want[top] = sums[top]
    for res in out:
        assert res.nnz == 1 and torch.equal(res.to_dense().to(torch.float64), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_oktopk_kept_set_past_delta_in_16_bit(dtype: torch.dtype) -> None:
    # P = 2, N = 3, k = 3: the kept set passes delta; it once turned into a dense
    # stream over all N and raised a false RankMismatchError
    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        acc = torch.randn(3, generator=g).to(dtype)
        return acc, oktopk_allreduce(acc, 3, comm, OkTopkState()).stream

    out = run_ranks(2, fn)
    assert out[0][1].equal(out[1][1])
    want = (out[0][0].to(torch.float64) + out[1][0].to(torch.float64)).to(dtype)
    assert torch.equal(out[0][1].to_dense(), want)
