"""Property tests of every sparse allreduce algorithm on in-process ranks.

World sizes 1-9 and 16, sizes including primes and N < P, every index pattern
of ``conftest.PATTERNS``, every dtype. Integer-valued inputs make every sum exact
in every dtype (|sum| <= 4 * 16 = 64 fits even bfloat16's 8-bit mantissa), so
the comparison with the dense reference is exact; random-valued float inputs are
compared with a stated tolerance. Results must be bitwise identical on all ranks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from inputs import PATTERNS, dense_reference, make_stream
from sparcml import SparseStream, algorithms, sparse_allgather, sparse_allreduce
from sparcml.collectives.registry import algorithm_info
from sparcml.comm import run_ranks
from sparcml.errors import CommTimeoutError, RankMismatchError
from sparcml.stream import SUPPORTED_DTYPES

# aliases (topkdsa = ssar_split_allgather) are the same function: tested once
ALGORITHMS = [*algorithms(exact=True, aliases=False, variants=False), "auto"]
WORLDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]


def _reduce_all(world, size, pattern, dtype, algorithm, integer=True):  # type: ignore[no-untyped-def]
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream(pattern, comm.rank, world, size, dtype, integer=integer)
        return s, sparse_allreduce(s, comm, algorithm=algorithm)

    out = run_ranks(world, fn)
    inputs = [o[0] for o in out]
    results = [o[1] for o in out]
    return inputs, results


def _check(inputs, results, exact=True, rtol=0.0):  # type: ignore[no-untyped-def]
    ref = dense_reference(inputs)
    first = results[0]
    for r, res in enumerate(results):
        assert res.size == ref.numel() and res.dtype == inputs[0].dtype
        assert res.equal(first), f"rank {r} result differs from rank 0's bits"
    got = first.to_dense().to(torch.float64)
    if exact:
        assert torch.equal(got, ref)
    else:
        scale = torch.stack([s.to_dense().abs().to(torch.float64) for s in inputs]).sum(0)
        assert torch.all((got - ref).abs() <= rtol * scale + 1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_patterns_and_sizes_exact(world: int, algorithm: str) -> None:
    for size, pattern in itertools.product([1, 3, 13, 97, 1000], PATTERNS):
        inputs, results = _reduce_all(world, size, pattern, torch.float32, algorithm)
        _check(inputs, results)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_dtype_exact(dtype: torch.dtype, algorithm: str) -> None:
    for world, pattern in itertools.product([2, 5, 8], ["random", "overlap", "dense"]):
        inputs, results = _reduce_all(world, 211, pattern, dtype, algorithm)
        _check(inputs, results)


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)],
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_random_values_within_tolerance(dtype: torch.dtype, rtol: float, algorithm: str) -> None:
    # Tolerance: |result - exact| <= rtol * sum_i |x_i| per entry (P-1 roundings of
    # at most one ulp each, with headroom).
    for world, pattern in itertools.product([3, 7], ["random", "overlap", "dense"]):
        inputs, results = _reduce_all(world, 500, pattern, dtype, algorithm, integer=False)
        _check(inputs, results, exact=False, rtol=rtol)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_and_inf_are_carried_through(algorithm: str) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("overlap", comm.rank, comm.world_size, 50)
        x = s.to_dense()
        if comm.rank == 1:
            x[3] = float("nan")
            x[4] = float("inf")
        return sparse_allreduce(SparseStream.from_dense(x), comm, algorithm=algorithm)

    out = run_ranks(5, fn)
    for res in out:
        d = res.to_dense()
        assert torch.isnan(d[3]) and d[4] == float("inf")
        assert res.equal(out[0])


@pytest.mark.parametrize("world", [1, 2, 3, 6, 8])
def test_sparse_allgather_returns_every_stream(world: int) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, world, 40 + comm.rank)  # sizes differ
        return s, sparse_allgather(s, comm)

    out = run_ranks(world, fn)
    for rank, (mine, gathered) in enumerate(out):
        assert len(gathered) == world
        for j in range(world):
            assert gathered[j].equal(out[j][0])
        # this rank's own entry is not decoded again, but a copy: never its input
        own = gathered[rank]
        assert own is not mine
        if own.nnz:
            assert own.values.data_ptr() != mine.values.data_ptr()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_mismatched_size_fails_on_every_rank(algorithm: str) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream.empty(100 if comm.rank != 2 else 99)
        try:
            sparse_allreduce(s, comm, algorithm=algorithm)
        except RankMismatchError as e:
            return str(e)
        return "no error"

    msgs = run_ranks(4, fn)
    assert all("rank 2: N=99" in m for m in msgs), msgs


def test_mismatched_dtype_fails_on_every_rank() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        dtype = torch.float64 if comm.rank == 1 else torch.float32
        try:
            sparse_allreduce(SparseStream.empty(10, dtype), comm)
        except RankMismatchError as e:
            return str(e)
        return "no error"

    assert all("rank 1: torch.float64" in m for m in run_ranks(3, fn))


def _named_when_absent(absent: int, algorithm: str = "auto", **kw):  # type: ignore[no-untyped-def]
    """A rank function: rank ``absent`` never calls; the others return the peer
    their timeout names. With ``settle``: every rank first makes one call, so that
    ``auto``'s choice is settled."""
    settle = kw.pop("settle", False)

    def fn(comm):  # type: ignore[no-untyped-def]
        if settle:
            sparse_allreduce(SparseStream.empty(10), comm, algorithm=algorithm, **kw)
        if comm.rank == absent:
            return None
        try:
            sparse_allreduce(SparseStream.empty(10), comm, algorithm=algorithm, **kw)
        except CommTimeoutError as e:
            return e.peer
        return "no error"

    return fn


def test_rank_that_never_joins_is_named() -> None:
    assert run_ranks(3, _named_when_absent(2), timeout=0.5) == [2, 2, None]


def test_check_takes_log_p_messages_and_names_an_absent_rank_beyond_the_partners() -> None:
    """The header exchange is recursive doubling: 3 messages per rank at P = 8. Rank 3
    stays away at P = 4: rank 2 waits on it directly, ranks 0 and 1 wait on ranks 2
    and 3 in the second round; every one of them names rank 3."""
    from sparcml.collectives.headers import check_consistent

    def count(comm):  # type: ignore[no-untyped-def]
        check_consistent(SparseStream.empty(10), comm)
        return comm.stats.messages_sent

    assert run_ranks(8, count) == [3] * 8

    assert run_ranks(4, _named_when_absent(3), timeout=0.3) == [3, 3, 3, None]


CARRIED = [
    a
    for a in ALGORITHMS
    if a != "auto"
    and (algorithm_info(a).header_in_first_round or algorithm_info(a).header_in_rounds)
]


def test_the_algorithms_that_carry_the_header() -> None:
    assert set(CARRIED) >= {"ssar_split_allgather", "dsar_split_allgather", "ssar_recursive_double"}


@pytest.mark.parametrize("algorithm", CARRIED)
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_an_explicit_call_checks_in_its_own_messages(algorithm: str, world: int) -> None:
    """Called by name, a split-phase algorithm (header in the first round) or
    recursive doubling (headers in every round, the fold included at P = 3, 5) sends
    no message beyond its own, returns the same bits as the bare algorithm, and
    every rank still raises the same error for mismatched sizes, dtypes, call_ids
    and NaN under a quantizer, or names a rank that never calls."""
    from sparcml.collectives import get_algorithm
    from sparcml.errors import NonFiniteError
    from sparcml.wire import encode

    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("overlap", comm.rank, comm.world_size, 300)
        comm.stats.reset()
        bare = get_algorithm(algorithm)(s, comm)
        bare_msgs = comm.stats.messages_sent
        comm.stats.reset()
        got = sparse_allreduce(s, comm, algorithm=algorithm)
        msgs = comm.stats.messages_sent
        errors = []
        cases = [
            (SparseStream.empty(10, torch.float64 if comm.rank == 1 else torch.float32), {}),
            (SparseStream.empty(11 if comm.rank == world - 2 else 10), {}),
            (SparseStream.empty(10), {"call_id": 7 if comm.rank == world - 1 else 6}),
            (
                SparseStream.dense(torch.full((12,), math.nan if comm.rank == 0 else 1.0)),
                {"quantizer": "natural", "quantize": "all"},
            ),
        ]
        for case, kw in cases:
            try:
                sparse_allreduce(case, comm, algorithm=algorithm, **kw)
                errors.append("no error")
            except (RankMismatchError, NonFiniteError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        return msgs, bare_msgs, encode(bare), encode(got), errors

    out = run_ranks(world, fn)
    for msgs, bare_msgs, bare, got, errors in out:
        assert msgs == bare_msgs and torch.equal(bare, got)
        assert torch.equal(got, out[0][3])
        assert errors == out[0][4]  # the same error on every rank
    errors = out[0][4]
    assert errors[0].startswith("RankMismatchError") and "rank 1: torch.float64" in errors[0]
    assert errors[1].startswith("RankMismatchError") and f"rank {world - 2}: N=11" in errors[1]
    assert errors[2].startswith("RankMismatchError") and f"rank {world - 1}: call_id 7" in errors[2]
    assert errors[3].startswith("NonFiniteError") and "rank(s) [0]" in errors[3]
    absent = world - 1
    named = run_ranks(world, _named_when_absent(absent, algorithm), timeout=0.3)
    assert named == [absent] * (world - 1) + [None]


def test_unknown_algorithm_and_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"unknown allreduce algorithm 'fast'.*ssar_split"):
        sparse_allreduce(SparseStream.empty(3), algorithm="fast")
    with pytest.raises(TypeError, match="from_dense"):
        sparse_allreduce(torch.zeros(3))  # type: ignore[arg-type]


def test_world_of_one_needs_no_process_group() -> None:
    s = SparseStream(torch.tensor([2]), torch.tensor([5.0]), 4)
    for algorithm in ALGORITHMS:
        assert torch.equal(sparse_allreduce(s, algorithm=algorithm).to_dense(), s.to_dense())


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_auto_carries_the_headers_once_it_settled(world: int) -> None:
    """``auto`` exchanges headers first while it has no choice for a call; once
    its calls settled, the next call runs the settled algorithm with the headers
    in its own messages: the bare algorithm's messages and bits. That happens when
    every call so far settled on one algorithm (whatever this call's N), or when
    this call's (N, value size, codec) settled on recursive doubling, whose rounds
    are the exchange's own. Calls that do not match fail alike on every rank in
    every case: a mismatch inside the common algorithm, recursive doubling on some
    ranks and the exchange on another, a rank naming the algorithm while another
    asks ``auto`` (before any history), NaN under a quantizer."""
    from sparcml.collectives import get_algorithm
    from sparcml.collectives.autotune import _SETTLED, common_choice, remember
    from sparcml.costmodel import CostModel
    from sparcml.errors import NonFiniteError
    from sparcml.wire import encode

    model = CostModel(alpha=1e-3, beta=1e-9, gamma=1e-9)  # latency-bound: recursive doubling
    rd, split = "ssar_recursive_double", "ssar_split_allgather"

    def fn(comm):  # type: ignore[no-untyped-def]
        errors = []

        def attempt(stream, **kw):  # type: ignore[no-untyped-def]
            try:
                sparse_allreduce(stream, comm, cost_model=model, **kw)
                errors.append("no error")
            except (RankMismatchError, NonFiniteError) as e:
                errors.append(f"{type(e).__name__}: {e}")

        # no history yet: rank 0's auto exchanges first, the others name the algorithm
        attempt(SparseStream.empty(40), algorithm=rd if comm.rank else "auto")
        s = make_stream("overlap", comm.rank, comm.world_size, 300)
        bare = {}
        for name in (rd, split):
            comm.stats.reset()
            bare[name] = (encode(get_algorithm(name)(s, comm)), comm.stats.messages_sent)
        msgs, bits = [], []
        for n in (300, 300, 301, 302):
            t = s if n == 300 else make_stream("overlap", comm.rank, comm.world_size, n)
            comm.stats.reset()
            bits.append(encode(sparse_allreduce(t, comm, cost_model=model)))
            msgs.append(comm.stats.messages_sent)
        assert common_choice(comm) == rd
        # every call settled on recursive doubling: it runs whatever a rank's N
        attempt(SparseStream.empty(999 if comm.rank == world - 1 else 300))
        # two algorithms in the history: N = 300 (settled: recursive doubling) carries,
        # a new N exchanges first; mixed, every rank refuses
        remember(comm, (77, 4, False), split)
        comm.stats.reset()
        again = encode(sparse_allreduce(s, comm, cost_model=model))
        carried_msgs = comm.stats.messages_sent
        attempt(SparseStream.empty(998 if comm.rank == world - 1 else 300))
        # NaN under a quantizer, in recursive doubling's rounds
        attempt(SparseStream.dense(torch.ones(12)), quantizer="natural", quantize="all")
        nan = torch.full((12,), math.nan if comm.rank == 0 else 1.0)
        attempt(SparseStream.dense(nan), quantizer="natural", quantize="all")
        # a history of the split allgather alone: auto runs it with the header
        _SETTLED[comm] = {}
        remember(comm, (5, 4, False), split)
        comm.stats.reset()
        split_bits = encode(sparse_allreduce(s, comm, cost_model=model))
        split_msgs = comm.stats.messages_sent
        return bare, msgs, bits, again, carried_msgs, split_bits, split_msgs, errors

    out = run_ranks(world, fn)
    for bare, msgs, bits, again, carried_msgs, split_bits, split_msgs, errors in out:
        assert msgs[0] > bare[rd][1]  # no history: the exchange first
        assert msgs[1] == msgs[2] == msgs[3] == bare[rd][1]  # carried, new N included
        assert torch.equal(bits[0], bare[rd][0]) and torch.equal(bits[1], bare[rd][0])
        assert carried_msgs == bare[rd][1] and torch.equal(again, bare[rd][0])
        assert split_msgs == bare[split][1] and torch.equal(split_bits, bare[split][0])
        assert torch.equal(bits[3], out[0][2][3])
        assert errors == out[0][7]  # the same errors on every rank
    errors = out[0][7]
    # the setting that differs is named (the headers' transport differs too)
    assert errors[0].startswith("RankMismatchError") and "different algorithm settings" in errors[0]
    assert "rank 0: 'auto'" in errors[0] and "rank 1: 'ssar_recursive_double'" in errors[0]
    assert errors[1].startswith("RankMismatchError") and f"rank {world - 1}: N=999" in errors[1]
    assert errors[2].startswith("RankMismatchError") and f"rank {world - 1}: N=998" in errors[2]
    assert errors[3] == "no error"
    assert errors[4].startswith("NonFiniteError") and "rank(s) [0]" in errors[4]


def test_auto_names_an_absent_rank_when_carrying_the_headers() -> None:
    from sparcml.costmodel import CostModel

    model = CostModel(alpha=1e-3, beta=1e-9, gamma=1e-9)  # settles on recursive doubling
    for world in (4, 5):
        named = run_ranks(world, _named_when_absent(3, settle=True, cost_model=model), timeout=0.3)
        assert named == [3, 3, 3, None, 3][:world]


def test_auto_never_carries_a_dense_result_over_to_another_size() -> None:
    """``auto`` runs the one algorithm every earlier call settled on without exchanging
    headers first; when that algorithm returns N dense values (DSAR, chosen for a
    small dense-ish class), a later call of a huge, nearly empty vector got N dense
    values back (memory unchecked). It exchanges headers and chooses for that call."""
    from sparcml import CostModel
    from sparcml.collectives.autotune import choose

    model = CostModel(alpha=1e-9, beta=1e-9, gamma=1e-4)
    small, huge = 4000, 10**7
    assert choose(model, 4, small, [2000] * 4, 4) == "dsar_split_allgather"
    assert choose(model, 4, huge, [1] * 4, 4) != "dsar_split_allgather"

    def fn(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(2):
            idx = torch.randperm(small, generator=g)[:2000]
            out = sparse_allreduce(
                SparseStream(idx, torch.randn(2000, generator=g), small), comm, cost_model=model
            )
            assert out.is_dense
        big = SparseStream(torch.tensor([comm.rank]), torch.ones(1), huge)
        out = sparse_allreduce(big, comm, cost_model=model)
        return out.is_dense, out.nnz

    assert run_ranks(4, fn) == [(False, 4)] * 4


def test_auto_with_different_cost_models_is_refused_naming_them() -> None:
    """``auto`` decides by the cost model where one is given or calibrated: ranks with
    different models (a calibration file on some hosts only) chose different
    algorithms in one call and failed on each other's messages (a wire-format error
    or a peer failure). The model's fingerprint is in the call's header: refused on
    every rank, naming the cause."""
    from sparcml import CostModel

    def fn(comm):  # type: ignore[no-untyped-def]
        model = CostModel(alpha=1e-2) if comm.rank == 0 else CostModel(gamma=1e-3)
        s = SparseStream(torch.tensor([comm.rank]), torch.ones(1), 4000)
        try:
            sparse_allreduce(s, comm, cost_model=model)
        except RankMismatchError as e:
            return str(e)
        return None

    msgs = run_ranks(4, fn)
    assert all(m is not None and "their cost models differ" in m for m in msgs), msgs
    # the same model everywhere (given, or none: measured) runs as before
    same = run_ranks(3, lambda c: sparse_allreduce(
        SparseStream(torch.tensor([c.rank]), torch.ones(1), 40), c, cost_model=CostModel()
    ).nnz)  # fmt: skip
    assert same == [3, 3, 3]


def test_a_quantizer_by_name_equals_the_same_quantizer_as_an_object() -> None:
    """``quantizer="qsgd"`` on one rank and ``get("qsgd")`` on another are the same
    settings (a name stands for its defaults): they were refused as different
    quantizer parameters. Other parameters still are."""
    from sparcml.compress import get

    def fn(comm, other):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank]), torch.ones(1), 10)
        q = "qsgd" if comm.rank == 0 else other
        try:
            out = sparse_allreduce(s, comm, algorithm="ssar_split_allgather", quantizer=q)
        except RankMismatchError as e:
            return str(e)
        return out.nnz

    assert run_ranks(2, lambda c: fn(c, get("qsgd"))) == [2, 2]
    msgs = run_ranks(2, lambda c: fn(c, get("qsgd", bits=8)))
    assert all("different quantizer parameters" in str(m) for m in msgs)
