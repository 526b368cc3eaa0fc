"""Two-level (hierarchical) sparse allreduce: topology, groups, both algorithms, auto.

Issue 31: every two-level algorithm exact and bitwise identical on every rank
over many node shapes (1 x P, P x 1, 2 x 3, 3 x 2, 4 x 4, nodes whose ranks are
not contiguous), on in-process ranks, spawned gloo ranks and the simulator;
irregular nodes refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inputs import PATTERNS, dense_reference, make_stream
from sparcml import SparseStream, sparse_allreduce
from sparcml.collectives import choose_algorithm
from sparcml.collectives.registry import algorithm_info, predict
from sparcml.comm import Topology, TopologyError, detect_topology, run_ranks
from sparcml.comm.sim import SimWorld, simulate_ranks
from sparcml.compress import get
from sparcml.costmodel import CostModel
from sparcml.errors import CommTimeoutError, RankMismatchError

TWO_LEVEL = ["twolevel_shard", "twolevel_leader"]
SHAPES = [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (2, 2), (4, 4), (3, 1), (1, 5)]


def _topology(nodes: int, per: int, interleaved: bool = False) -> Topology:
    if interleaved:  # rank r on node r % nodes: no node's ranks are contiguous
        return Topology.from_keys([r % nodes for r in range(nodes * per)])
    return Topology.regular(nodes * per, per)


@pytest.mark.parametrize("algo", TWO_LEVEL)
@pytest.mark.parametrize(("nodes", "per"), SHAPES)
def test_exact_and_bitwise_identical_on_every_shape(algo: str, nodes: int, per: int) -> None:
    p = nodes * per
    cases = [
        (size, pattern, dtype)
        for pattern in PATTERNS
        for size, dtype in ((97, torch.float32), (3, torch.float64), (1, torch.float32))
    ] + [(70_001, "random", torch.float32), (5000, "identical", torch.bfloat16)]

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(nodes, per))
        out = []
        for size, pattern, dtype in cases:
            s = make_stream(pattern, comm.rank, p, size, dtype)
            out.append(sparse_allreduce(s, comm, algorithm=algo).to_dense())
        return out

    results = run_ranks(p, fn)
    for i, (size, pattern, dtype) in enumerate(cases):
        ref = dense_reference([make_stream(pattern, r, p, size, dtype) for r in range(p)])
        for r in range(p):
            assert torch.equal(results[r][i], results[0][i]), (size, pattern, r)
        assert torch.equal(results[0][i].double(), ref), (size, pattern, dtype)


@pytest.mark.parametrize("algo", TWO_LEVEL)
@pytest.mark.parametrize("inner", ["ssar_split_allgather", "dsar_split_allgather", "dense"])
def test_interleaved_nodes_and_every_inner_algorithm(algo: str, inner: str) -> None:
    """Nodes whose ranks are not contiguous (r on node r % 2), strided input values,
    random non-integer values against a float64 reference (tolerance 1e-5)."""
    nodes, per, size = 2, 3, 4000

    def stream(rank: int) -> SparseStream:
        g = torch.Generator().manual_seed(rank)
        idx = torch.randperm(size, generator=g)[:300]
        vals = torch.randn(600, generator=g, dtype=torch.float64)[::2]  # strided
        return SparseStream(idx, vals, size)

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(nodes, per, interleaved=True))
        assert comm.topology.node_ranks(comm.rank) == tuple(
            r for r in range(nodes * per) if r % nodes == comm.rank % nodes
        )
        return sparse_allreduce(stream(comm.rank), comm, algorithm=algo, inner=inner).to_dense()

    out = run_ranks(nodes * per, fn)
    ref = dense_reference([stream(r) for r in range(nodes * per)])
    assert all(torch.equal(o, out[0]) for o in out)
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-12)


# (algorithm, nodes, ranks per node, the flat algorithm that quantizes each rank's
# contribution in the same pieces): the leader's ranks send their whole stream (as
# recursive doubling's first round); on one node the shard arrangement splits it in
# P pieces (as the split allgather); on one rank per node it is the inner algorithm
QUANTIZED = [
    ("twolevel_leader", 2, 2, "ssar_recursive_double"),
    ("twolevel_leader", 1, 4, "ssar_recursive_double"),
    ("twolevel_shard", 1, 4, "ssar_split_allgather"),
    ("twolevel_shard", 4, 1, "ssar_recursive_double"),
    ("twolevel_shard", 2, 2, None),
]


@pytest.mark.parametrize(("algo", "nodes", "per", "flat_algo"), QUANTIZED)
@pytest.mark.parametrize("mode", ["dense", "contributions", "all"])
def test_quantized_bitwise_identical_and_contributions_match_flat(
    algo: str, nodes: int, per: int, flat_algo: str | None, mode: str
) -> None:
    """With a quantizer every rank still holds the same bits. Under
    ``quantize="contributions"`` every rank's own stream is quantized once (SparCML's
    Alg. 1), so the result equals the flat algorithm's that quantizes the same
    pieces with the same seeds, up to the order of the exact additions (1e-5)."""
    size = 3000
    q = get("qsgd", bits=8, seed=7)

    def stream(rank: int) -> SparseStream:
        g = torch.Generator().manual_seed(10 + rank)
        idx = torch.randperm(size, generator=g)[:900]
        return SparseStream(idx, torch.randn(900, generator=g), size)

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(nodes, per))
        s = stream(comm.rank)
        two = sparse_allreduce(s, comm, algorithm=algo, quantizer=q, quantize=mode)
        if flat_algo is None:
            return two.to_dense(), None
        comm.sequence -= 1  # the flat call with the same call number: the same seeds
        flat = sparse_allreduce(s, comm, algorithm=flat_algo, quantizer=q, quantize=mode)
        return two.to_dense(), flat.to_dense()

    out = run_ranks(nodes * per, fn)
    for two, _ in out:
        assert torch.equal(two, out[0][0])
    ref = dense_reference([stream(r) for r in range(nodes * per)]).float()
    # quantized, not garbage: QSGD's variance bound at 8 bits, s = 255 levels:
    # E|Q(v) - v|^2 <= sqrt(n)/s |v|^2, n = 900 per rank: 0.12, so well under 0.5
    assert (out[0][0] - ref).norm() < 0.5 * ref.norm()
    if mode == "contributions" and flat_algo is not None:
        torch.testing.assert_close(out[0][0], out[0][1], rtol=0, atol=1e-5)


def test_irregular_and_invalid_topologies_are_refused() -> None:
    with pytest.raises(TopologyError, match=r"irregular nodes .*node 1: 1 ranks"):
        Topology(((0, 1, 2), (3,)))
    with pytest.raises(TopologyError, match=r"every rank 0\.\.P-1"):
        Topology(((0, 1), (1, 2)))
    with pytest.raises(TopologyError, match="cannot form nodes of 4"):
        Topology.regular(6, 4)
    with pytest.raises(TopologyError, match="irregular"):
        Topology.from_keys(["a", "a", "b"])

    def fn(comm):  # type: ignore[no-untyped-def]
        with pytest.raises(TopologyError, match="places 4 ranks, the communicator has 3"):
            comm.set_topology(Topology.regular(4, 2))
        with pytest.raises(TypeError, match="expected a Topology"):
            comm.set_topology((2, 2))
        return True

    assert all(run_ranks(3, fn))


def test_ranks_per_node_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARCML_RANKS_PER_NODE", "2")
    topos = run_ranks(6, lambda comm: comm.topology)
    assert (
        all(t == Topology.regular(6, 2) for t in topos) and str(topos[0]) == "3 node(s) x 2 rank(s)"
    )
    monkeypatch.setenv("SPARCML_RANKS_PER_NODE", "4")
    with pytest.raises(TopologyError, match="6 ranks cannot form nodes of 4"):
        run_ranks(6, detect_topology)
    monkeypatch.setenv("SPARCML_RANKS_PER_NODE", "two")
    with pytest.raises(TopologyError, match="positive integer, got 'two'"):
        run_ranks(2, detect_topology)
    monkeypatch.delenv("SPARCML_RANKS_PER_NODE")
    # in-process ranks are one node, found without a message
    assert run_ranks(3, lambda c: (detect_topology(c), c.stats.messages_sent))[0] == (
        Topology.regular(3, 3), 0)  # fmt: skip


@pytest.mark.parametrize("algo", TWO_LEVEL)
def test_bad_inner_algorithm_fails_alike_on_every_rank(algo: str) -> None:
    def fn(comm, inner):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 2))
        s = make_stream("random", comm.rank, 4, 50)
        try:
            sparse_allreduce(s, comm, algorithm=algo, inner=inner)
        except ValueError as e:
            return str(e)
        return None

    for inner, why in (("nope", "unknown allreduce algorithm 'nope'"),
                       ("twolevel_shard", "must be a flat exact"),
                       ("oktopk", "must be a flat exact")):  # fmt: skip
        msgs = run_ranks(4, fn, inner)
        assert all(m is not None and why in m for m in msgs), msgs


def test_different_inner_algorithms_are_a_mismatch_on_every_rank() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 2))
        inner = "ssar_split_allgather" if comm.rank == 3 else "ssar_recursive_double"
        with pytest.raises(RankMismatchError):
            sparse_allreduce(make_stream("random", comm.rank, 4, 50), comm,
                             algorithm="twolevel_shard", inner=inner)  # fmt: skip
        return True

    assert all(run_ranks(4, fn))


def test_group_traffic_is_counted_and_a_silent_rank_is_named() -> None:
    """A node group's messages count in the parent's stats and its own; a rank of
    the group that never sends is named by its parent rank."""

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 2))
        node = comm.subgroup(comm.topology.node_ranks(comm.rank))
        before = comm.stats.bytes_sent
        node.allgather(torch.tensor([comm.rank], dtype=torch.int64))
        counted = (comm.stats.bytes_sent - before, node.stats.bytes_sent)
        if comm.rank == 3:
            return counted, None
        if comm.rank == 2:
            try:
                node.recv(1)
            except CommTimeoutError as e:
                return counted, e.peer
        return counted, None

    out = run_ranks(4, fn, timeout=1.0)
    assert all(c == (8, 8) for c, _ in out)
    assert out[2][1] == 3  # the parent's rank, not the group's rank 1


def test_auto_takes_the_topology() -> None:
    """On one node ``auto`` never runs a two-level algorithm; on 2 x 4 ranks sharing a
    1 Gbit/s NIC per node, at N = 16M and d = 0.78%, the model predicts the
    shard-parallel arrangement faster than every flat algorithm and picks it."""
    model = CostModel(alpha=50e-6, beta=8e-9, gamma=1e-9)
    n, ks = 1 << 24, [131_072] * 8
    on_nodes = model.for_topology(4)
    two = predict(on_nodes, "twolevel_shard", 8, n, ks, 4)
    flat = min(predict(on_nodes, a, 8, n, ks, 4) for a in ("ssar_recursive_double",
                                                           "ssar_split_allgather"))  # fmt: skip
    assert two < flat / 2, (two, flat)
    # sharing the NIC makes a flat algorithm's prediction slower, the dense ring's not
    assert predict(on_nodes, "ssar_split_allgather", 8, n, ks, 4) > predict(
        model, "ssar_split_allgather", 8, n, ks, 4)  # fmt: skip
    assert predict(on_nodes, "dense", 8, n, ks, 4) == predict(model, "dense", 8, n, ks, 4)

    def fn(comm, topo):  # type: ignore[no-untyped-def]
        if topo is not None:
            comm.set_topology(topo)
        s = SparseStream(torch.arange(comm.rank, n, 128), torch.ones(n // 128), n)
        return choose_algorithm(s, comm, cost_model=model)

    assert set(run_ranks(8, fn, Topology.regular(8, 4))) == {"twolevel_shard"}
    assert not algorithm_info(run_ranks(8, fn, None)[0]).two_level


@pytest.mark.parametrize("algo", TWO_LEVEL)
@pytest.mark.parametrize("inner", ["ssar_split_allgather", "dsar_split_allgather"])
def test_inner_variants_are_the_algorithm_with_that_inner(algo: str, inner: str) -> None:
    """``twolevel_shard+dsar_split_allgather`` (auto's name for the choice between
    nodes) gives the bits of ``twolevel_shard(inner="dsar_split_allgather")``, on
    contiguous and interleaved nodes; exact against a float64 reference."""
    name = f"{algo}+{inner}"
    assert algorithm_info(name).variant_of == algo

    def fn(comm, topo):  # type: ignore[no-untyped-def]
        comm.set_topology(topo)
        s = make_stream("random", comm.rank, 6, 5000, torch.float64)
        return (
            sparse_allreduce(s, comm, algorithm=name).to_dense(),
            sparse_allreduce(s, comm, algorithm=algo, inner=inner).to_dense(),
        )

    ref = dense_reference([make_stream("random", r, 6, 5000, torch.float64) for r in range(6)])
    for topo in (_topology(2, 3), _topology(3, 2, interleaved=True)):
        out = run_ranks(6, fn, topo)
        for variant, explicit in out:
            assert torch.equal(variant, explicit) and torch.equal(variant, out[0][0])
        torch.testing.assert_close(out[0][0], ref, rtol=0, atol=1e-12)


def test_auto_chooses_the_inner_algorithm_by_the_model() -> None:
    """On 2 x 4 ranks the model keeps recursive doubling between the two nodes; on
    8 x 8 the nodes' sums fill in and it picks the split allgather between nodes.
    ``auto`` measures one inner per two-level algorithm (the model's best), not all."""
    from sparcml.collectives.autotune import choose, measured_candidates
    from sparcml.collectives.registry import algorithms

    model = CostModel()  # the defaults: what a user without a calibration file gets
    names = algorithms(auto=True)
    n = 1 << 24
    assert choose(model.for_topology(4), 8, n, [131_072] * 8, 4, names) == "twolevel_shard"
    on_8x8 = model.for_topology(8)
    ks = [131_072] * 64
    picked = choose(on_8x8, 64, n, ks, 4, names)
    assert picked == "twolevel_shard+ssar_split_allgather"
    assert predict(on_8x8, picked, 64, n, ks, 4) < predict(on_8x8, "twolevel_shard", 64, n, ks, 4)
    cands, _ = measured_candidates(on_8x8, 64, n, ks, 4, names)
    bases = [algorithm_info(a).base for a in cands]
    assert len(bases) == len(set(bases)) and picked in cands, cands


def test_auto_measures_two_level_candidates_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Without a calibration file ``auto`` measures; on a 2 x 2 topology its
    candidates include ``twolevel_shard``, and every call is exact and identical."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", float("inf"))

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 2))
        s = make_stream("random", comm.rank, 4, 4000)
        outs = [sparse_allreduce(s, comm).to_dense() for _ in range(12)]
        return outs, autotune.auto_choices(comm)[0].candidates

    out = run_ranks(4, fn)
    ref = dense_reference([make_stream("random", r, 4, 4000) for r in range(4)])
    assert "twolevel_shard" in out[0][1]
    for outs, _ in out:
        for o in outs:
            assert torch.equal(o.double(), ref)


@pytest.mark.parametrize("algo", TWO_LEVEL)
def test_simulated_two_level_topology_costs_both_pairs(algo: str) -> None:
    """The simulator runs the two-level algorithms on a node topology with both cost
    pairs: exact results, and a slower NIC makes the call slower while a slower
    inside-node link does too (both levels are charged)."""
    nodes, per, size = 4, 2, 20_000

    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, nodes * per, size, integer=True)
        comm.reset_clock()
        out = sparse_allreduce(s, comm, algorithm=algo)
        return out.to_dense(), comm.now()

    def run(model: CostModel):  # type: ignore[no-untyped-def]
        res = simulate_ranks(
            nodes * per, fn, model=model, topology=Topology.regular(nodes * per, per)
        )
        return res

    base = CostModel(alpha=10e-6, beta=1e-9, gamma=0.0, alpha_intra=1e-6, beta_intra=1e-10)
    a = run(base)
    ref = dense_reference([make_stream("random", r, nodes * per, size) for r in range(nodes * per)])
    assert all(torch.equal(o.double(), ref) for o, _ in a.results)
    slow_nic = run(dataclasses.replace(base, beta=1e-8))
    slow_inside = run(dataclasses.replace(base, beta_intra=1e-8))
    assert slow_nic.time > 2 * a.time and slow_inside.time > 1.5 * a.time, (
        a.time, slow_nic.time, slow_inside.time)  # fmt: skip


def test_world_of_sim_refuses_a_topology_of_another_size() -> None:
    with pytest.raises(TopologyError, match="places 4 ranks"):
        SimWorld(3, CostModel(), topology=Topology.regular(4, 2))


@pytest.mark.spawn
@pytest.mark.parametrize("world", [4, 6])
def test_two_level_over_gloo_with_the_launchers_node_rank(world: int) -> None:
    import gloo_workers
    from sparcml.comm.launch import run_processes
    from sparcml.wire import decode

    out = run_processes(world, gloo_workers.two_level, timeout=60)
    half = world // 2
    for r, (topo, node, _) in enumerate(out):
        assert topo == f"2 node(s) x {half} rank(s)"
        assert node == tuple(range(r // half * half, r // half * half + half))
    cases = out[0][2]
    for i, (size, pattern, algo, _, result) in enumerate(cases):
        ref = dense_reference([decode(o[2][i][3]) for o in out])
        for o in out:
            assert torch.equal(o[2][i][4], result), (size, pattern, algo)
        assert torch.equal(decode(result).to_dense().double(), ref), (size, pattern, algo)


@pytest.mark.spawn
def test_ddp_hook_on_two_nodes_reproduces_plain_ddp() -> None:
    import gloo_workers
    import train_workers
    from sparcml.comm.launch import run_processes

    steps = 4
    plain = run_processes(4, train_workers.ddp_train, None, {}, steps, False, timeout=60)
    out = run_processes(4, gloo_workers.two_level_ddp, steps, timeout=60)
    for r in range(4):
        assert torch.equal(out[r]["params"], out[0]["params"])
        torch.testing.assert_close(out[r]["params"], plain[r]["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("nodes", "per", "interleaved"),
                         [(2, 2, False), (2, 3, False), (3, 2, False), (2, 2, True),
                          (1, 4, False), (4, 1, False)])  # fmt: skip
def test_reduce_scatter_in_two_levels_gives_every_rank_its_range(
    nodes: int, per: int, interleaved: bool
) -> None:
    """Rank r gets range r of the sum (uneven ranges, an empty one), exactly on
    integer data; the same as the flat split phase."""
    from sparcml.collectives import reduce_scatter
    from sparcml.collectives._common import split_and_reduce

    p, size = nodes * per, 997
    cut = sorted(torch.randperm(size - 1, generator=torch.Generator().manual_seed(3))[: p - 2])
    bounds = [0, 0, *[int(c) + 1 for c in cut], size]  # rank 0's range is empty

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(nodes, per, interleaved))
        s = make_stream("overlap", comm.rank, p, size)
        two = reduce_scatter(s, comm, bounds=bounds).to_dense()
        flat = split_and_reduce(s, comm, bounds=bounds)[0].to_dense()
        return two, flat

    out = run_ranks(p, fn)
    ref = dense_reference([make_stream("overlap", r, p, size) for r in range(p)])
    for r, (two, flat) in enumerate(out):
        assert torch.equal(two.double(), ref[bounds[r] : bounds[r + 1]]), r
        assert torch.equal(two, flat)

    def bad(comm):  # type: ignore[no-untyped-def]
        with pytest.raises(ValueError, match="bounds must be"):
            reduce_scatter(make_stream("random", comm.rank, p, size), comm, bounds=[0, size])
        return True

    assert all(run_ranks(p, bad))


@pytest.mark.spawn
def test_fsdp_reduce_scatter_on_two_nodes() -> None:
    """FSDP2 through sparcml's reduce-scatter on 2 x 2 gloo ranks (two levels): the
    lossless methods reproduce plain FSDP, every method is bitwise identical on every
    rank, and a quantizer still trains."""
    import gloo_workers
    from sparcml.comm.launch import run_processes

    out = run_processes(4, gloo_workers.two_level_fsdp, 4, timeout=120)
    assert all(o["topology"] == "2 node(s) x 2 rank(s)" for o in out)
    plain = out[0]["plain"]["params"]
    for label in ("nonzeros", "topk1", "natural"):
        for o in out:
            assert torch.equal(o[label]["params"], out[0][label]["params"]), label
    for label in ("nonzeros", "topk1"):
        torch.testing.assert_close(out[0][label]["params"], plain, rtol=0, atol=1e-6)
    losses = out[0]["natural"]["losses"]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("nodes", "per"), [(2, 2), (2, 3), (3, 2)])
def test_oktopk_on_nodes_equals_flat(nodes: int, per: int) -> None:
    """Ok-Topk's split-and-reduce and balanced allgather in two levels
    (``OkTopkState(two_level=True)``) give the flat
    run's result (integer-valued accumulators: every sum exact, so the thresholds
    agree) over calls that refresh and reuse thresholds and boundaries; bitwise
    identical on every rank."""
    from sparcml import OkTopkState, oktopk_allreduce

    p = nodes * per

    def fn(comm, topo):  # type: ignore[no-untyped-def]
        if topo is not None:
            comm.set_topology(topo)
        state = OkTopkState(tau=2, tau_prime=3, two_level=topo is not None)
        outs = []
        for call in range(5):
            g = torch.Generator().manual_seed(100 * call + comm.rank)
            acc = torch.randint(-50, 51, (3000,), generator=g).float()
            res = oktopk_allreduce(acc, 60, comm, state)
            outs.append((res.stream.to_dense(), res.local_indices.clone()))
        return outs

    flat = run_ranks(p, fn, None)
    two = run_ranks(p, fn, Topology.regular(p, per))
    for r in range(p):
        for (tf, lf), (tt, lt) in zip(flat[r], two[r], strict=True):
            assert torch.equal(tt, tf) and torch.equal(lt, lf)
    for call in range(5):
        assert all(torch.equal(two[r][call][0], two[0][call][0]) for r in range(p))


@pytest.mark.parametrize(("nodes", "per", "interleaved"),
                         [(2, 2, False), (2, 3, False), (3, 2, False), (2, 4, False),
                          (4, 2, False), (2, 3, True), (1, 4, False), (4, 1, False)])  # fmt: skip
@pytest.mark.parametrize("algo", ["topka", "gaussiank"])
def test_topk_family_gathers_in_two_levels_on_nodes(
    algo: str, nodes: int, per: int, interleaved: bool
) -> None:
    """TopkA and Gaussiank (``node_aware``) allgather across nodes lane by lane, then
    inside the node: the flat run's result bit for bit on every rank, with fewer
    bytes leaving each node (a block crosses to each other node once, not once per
    rank there)."""
    p = nodes * per
    topo = _topology(nodes, per, interleaved)
    node_of = {r: n for n, ranks in enumerate(topo.nodes) for r in ranks}

    def fn(comm, on_nodes: bool):  # type: ignore[no-untyped-def]
        if on_nodes:
            comm.set_topology(topo)
        across = [0]
        send = comm.isend

        def counted(buf, dst, tag=0, **kw):  # type: ignore[no-untyped-def]
            if node_of[dst] != node_of[comm.rank]:
                across[0] += buf.numel()
            return send(buf, dst, tag, **kw)

        comm.isend = counted
        g = torch.Generator().manual_seed(comm.rank)
        if algo == "topka":
            idx = torch.randperm(5000, generator=g)[:80]
            out = sparse_allreduce(
                SparseStream(idx, torch.randn(80, generator=g), 5000), comm, "topka"
            )
        else:
            acc = SparseStream.dense(torch.randn(5000, generator=g))
            out = sparse_allreduce(acc, comm, "gaussiank", k=80)
        return out.to_dense(), across[0]

    flat = run_ranks(p, fn, False)
    two = run_ranks(p, fn, True)
    for r in range(p):
        assert torch.equal(two[r][0], flat[r][0]) and torch.equal(two[r][0], two[0][0])
    if nodes > 1 and per > 1 and not interleaved:
        # (interleaved ranks: recursive doubling's first partner sits on the other
        # node and the later ones on the same node: the flat pattern crosses as little)
        assert sum(b for _, b in two) < sum(b for _, b in flat)


def test_topk_family_cost_on_nodes() -> None:
    """TopkA's formula on nodes: the lanes' allgather across nodes (the NIC shared by
    the node's ranks) and the node's allgather inside, below the flat pattern through
    a shared NIC; one node costs the inside pair alone; the flat model is unchanged."""
    from sparcml.collectives.topka import cost

    m = CostModel(alpha=50e-6, beta=8e-9, gamma=1e-9, alpha_intra=10e-6, beta_intra=2.5e-10)
    n, ks = 1 << 24, [131_072] * 8
    on_nodes = predict(m.for_topology(4), "topka", 8, n, ks, 4)
    shared = cost(m.sharing_nic(4), 8, n, ks, 4)
    assert on_nodes < 0.5 * shared
    assert predict(m.for_topology(8), "topka", 8, n, ks, 4) == cost(m.inside(), 8, n, ks, 4)
    assert predict(m, "topka", 8, n, ks, 4) == cost(m, 8, n, ks, 4)
    assert algorithm_info("topka").node_aware and algorithm_info("gaussiank").node_aware
    # gTopk on 2 x 4: two of its three levels (up and down) at the inside pair, one
    # between nodes with the NIC not shared (the same merge work)
    from sparcml.collectives.gtopk import cost as gtopk_cost

    assert algorithm_info("gtopk").node_aware
    flat = gtopk_cost(m, 8, n, ks, 4)
    inside = gtopk_cost(m.inside(), 8, n, ks, 4)
    assert predict(m.for_topology(4), "gtopk", 8, n, ks, 4) == pytest.approx(
        flat / 3 + 2 * inside / 3
    )
    # 3 ranks a node: the tree's early levels cross nodes too, so every level is
    # charged between nodes (the flat formula, the NIC not shared)
    assert predict(m.for_topology(3), "gtopk", 6, n, ks[:6], 4) == gtopk_cost(m, 6, n, ks[:6], 4)


@pytest.mark.parametrize(("nodes", "per"), [(2, 4), (4, 2), (2, 3), (3, 2)])
def test_gtopk_tree_keeps_its_first_levels_inside_the_nodes(nodes: int, per: int) -> None:
    """gTopk (``node_aware``) runs its tree over the ranks in node order: on nodes
    whose ranks are interleaved (r on node r % nodes) the result is the flat tree's
    over the inputs renumbered node by node, identical on every rank; on contiguous
    nodes it is the flat run's bit for bit; and fewer messages cross nodes than in
    the flat tree over the interleaved ranks (with power-of-two nodes: two per level
    between nodes, up and down)."""
    from sparcml.collectives.gtopk import gtopk

    p = nodes * per
    inter = _topology(nodes, per, interleaved=True)
    order = [r for node in inter.nodes for r in node]

    def selection(r: int) -> SparseStream:
        g = torch.Generator().manual_seed(r)
        idx = torch.sort(torch.randperm(3000, generator=g)[:60]).values
        return SparseStream.from_sorted(idx, torch.randn(60, generator=g), 3000)

    def fn(comm, topo, inputs):  # type: ignore[no-untyped-def]
        if topo is not None:
            comm.set_topology(topo)
        crossed, send = [0], comm.isend

        def counted(buf, dst, tag=0, **kw):  # type: ignore[no-untyped-def]
            tree = buf.numel() > 64  # not step 1's 8-byte allreduce of k
            if tree and topo is not None and topo.node_of(dst) != topo.node_of(comm.rank):
                crossed[0] += 1
            return send(buf, dst, tag, **kw)

        comm.isend = counted
        out = gtopk(selection(inputs[comm.rank]), comm).to_dense()
        return out, crossed[0]

    def tree_crossings(ranks: list[int]) -> int:
        """Messages between nodes of the binomial tree over ``ranks`` (up and down)."""
        edges = [(ranks[v], ranks[v + d]) for d in (1 << i for i in range(p.bit_length()))
                 for v in range(0, p, 2 * d) if v + d < p]  # fmt: skip
        return 2 * sum(inter.node_of(a) != inter.node_of(b) for a, b in edges)

    aware = run_ranks(p, fn, inter, list(range(p)))
    renumbered = run_ranks(p, fn, None, order)
    assert all(torch.equal(o, renumbered[0][0]) for o, _ in aware)
    crossings = sum(c for _, c in aware)
    assert crossings == tree_crossings(order) < tree_crossings(list(range(p)))
    if per & (per - 1) == 0:
        assert crossings == 2 * (nodes - 1)
    contiguous = run_ranks(p, fn, _topology(nodes, per), list(range(p)))
    flat = run_ranks(p, fn, None, list(range(p)))
    assert all(torch.equal(c, f) for (c, _), (f, _) in zip(contiguous, flat, strict=True))


@pytest.mark.parametrize("algo", TWO_LEVEL)
def test_inside_the_node_exact_messages_carry_fixed_index_fields(algo: str) -> None:
    """Under ``index_coding="auto"`` the node steps send the fixed index fields (bytes
    are cheap there, Elias-Fano's CPU is not) and the messages between nodes
    Elias-Fano where it is smaller; ``index_coding="elias-fano"`` codes every one.
    The result is the same bits either way (lossless)."""
    from sparcml.wire import peek, peek_bundle

    topo = _topology(2, 2)
    n, k = 1 << 20, 1 << 13  # d = 0.78%: Elias-Fano is the smaller field

    def fn(comm, coding):  # type: ignore[no-untyped-def]
        comm.set_topology(topo)
        seen: dict[bool, set[bool]] = {True: set(), False: set()}  # inside? -> E-F flags
        send = comm.isend

        def counted(buf, dst, tag=0, **kw):  # type: ignore[no-untyped-def]
            inside = topo.node_of(dst) == topo.node_of(comm.rank)
            spans = peek_bundle(buf) or [(0, buf.numel())]
            for off, _ in spans:
                h = peek(buf, off)
                if h is not None and not h.dense and h.nnz > 1000:
                    seen[inside].add(h.elias_fano)
            return send(buf, dst, tag, **kw)

        comm.isend = counted
        g = torch.Generator().manual_seed(comm.rank)
        s = SparseStream(torch.randperm(n, generator=g)[:k], torch.randn(k, generator=g), n)
        out = sparse_allreduce(s, comm, algo, index_coding=coding).to_dense()
        return out, seen

    auto, ef = run_ranks(4, fn, "auto"), run_ranks(4, fn, "elias-fano")
    assert all(torch.equal(o, auto[0][0]) for o, _ in auto + ef)
    inside_auto = set().union(*(s[True] for _, s in auto))
    across_auto = set().union(*(s[False] for _, s in auto))
    assert inside_auto == {False} and across_auto == {True}, (inside_auto, across_auto)
    assert set().union(*(s[True] for _, s in ef)) == {True}


def test_codec_inside_the_node() -> None:
    from sparcml.collectives.codec import StreamCodec

    assert StreamCodec().inside_node().index_coding == "fixed"
    for named in ("fixed", "elias-fano", "delta"):
        c = StreamCodec(index_coding=named)
        assert c.inside_node() is c
    q = StreamCodec(get("qsgd", bits=4), "contributions")
    assert q.inside_node() is q  # quantized messages keep their coding and generators
    m = CostModel()
    assert m.inside(elias_fano=False).message_time(8192, 1 << 20, 4) > m.inside().message_time(
        8192, 1 << 20, 4
    )


def test_a_neighbours_winning_variant_keeps_its_algorithm_among_the_candidates(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A class one density step from one whose measured winner was a variant
    (``twolevel_leader+dsar_split_allgather``) measures that algorithm again, in the
    variant the model ranks best here, beside the model's best: the neighbour
    shortcut compares algorithms, not variant names."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    n, k = 1 << 24, 131_072

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 4))
        near = autotune.AutoClass.of(8, n, [2 * k] * 8, 4, False)
        won = autotune.AutoChoice(near, ["twolevel_leader+dsar_split_allgather"])
        won.winner = "twolevel_leader+dsar_split_allgather"
        autotune._CHOICES.setdefault(comm, {})[near] = won
        name, entry = autotune.plan(comm, n, [k] * 8, 4, False, None, create=True)
        return name, None if entry is None else entry.candidates

    for name, cands in run_ranks(8, fn):
        assert name is None and cands is not None
        bases = [algorithm_info(a).base for a in cands]
        assert bases[0] == "twolevel_shard" and "twolevel_leader" in bases, cands


@pytest.mark.parametrize(
    ("algo", "options"),
    [
        ("twolevel_shard+dsar_split_allgather", {}),
        ("twolevel_leader+dsar_split_allgather", {}),
        ("twolevel_shard", {"inner": "dense"}),
        ("twolevel_leader", {"inner": "dsar_split_allgather"}),
    ],
)
def test_a_dense_result_between_nodes_that_cannot_exist_is_refused(
    algo: str, options: dict
) -> None:
    """An audit found the two-level algorithms with a dense-result inner algorithm
    allocating N values between nodes (N = 2^40: a raw RuntimeError, or gigabytes at
    2^32 + 1), where dense and dsar_split_allgather themselves refuse; now the same
    ValueError on every rank before any message (on one node too: the topology is
    not known then), and the communicator stays usable."""
    n = 1 << 40

    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(_topology(2, 2))
        s = SparseStream(torch.tensor([comm.rank, n - 1]), torch.tensor([1.0, 2.0]), n)
        with pytest.raises(ValueError, match=r"returns a dense result: N = 1,099,511,627,776"):
            sparse_allreduce(s, comm, algorithm=algo, **options)
        out = sparse_allreduce(s, comm, algorithm=algo.split("+")[0])  # a sparse inner
        return out.nnz, float(out.values[-1])

    assert run_ranks(4, fn, timeout=60) == [(5, 8.0)] * 4


@pytest.mark.parametrize("size", [3, 1001, 1003, 7, 10])
def test_the_cost_formulas_stay_real_where_shares_round_above_their_range(size: int) -> None:
    """An audit found auto raising TypeError ('complex' > 'int') on 3 nodes x 2 ranks
    at N = 1003: a shard's rounded share of the fill-in exceeded its width, and
    recursive doubling's cost raised a negative base to a fractional power."""
    model = CostModel().for_topology(2)
    for algo in ("twolevel_shard", "twolevel_leader", *(
        f"{a}+{i}" for a in TWO_LEVEL for i in ("ssar_split_allgather", "dsar_split_allgather")
    )):  # fmt: skip
        t = predict(model, algo, 6, size, [size] * 6, 4)
        assert isinstance(t, float) and math.isfinite(t), (algo, size, t)


# --- found by a review: ranks that disagree on their nodes, inner='dense' quantized ---


def test_a_layout_has_one_spelling() -> None:
    # the same nodes in another order pair the same ranks (their leaders, their lanes)
    odd = Topology(((3, 2), (1, 0)))
    assert odd == Topology.regular(4, 2) and odd.nodes == ((0, 1), (2, 3))


@pytest.mark.parametrize("algorithm", ["twolevel_shard", "twolevel_leader", "topka", "auto"])
def test_ranks_that_disagree_on_their_nodes_are_refused_on_every_rank(algorithm: str) -> None:
    # rank 0 flat, the others 2 x 2 (one process's SPARCML_RANKS_PER_NODE differing):
    # the two-level algorithms summed the wrong pieces, silently, and differently per rank
    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(4, 1 if comm.rank == 0 else 2))
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 4)
        try:
            sparse_allreduce(s, comm, algorithm=algorithm)
        except RankMismatchError as e:
            return str(e)
        return "no error"

    for msg in run_ranks(4, fn, timeout=10):
        assert "different node topologies" in msg and "rank 0" in msg, msg


def test_a_flat_algorithm_ignores_a_disagreement_on_nodes() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(4, 1 if comm.rank == 0 else 2))
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 4)
        return sparse_allreduce(s, comm, algorithm="ssar_recursive_double").to_dense().tolist()

    assert run_ranks(4, fn) == [[1.0] * 4] * 4


@pytest.mark.parametrize(("nodes", "per"), [(1, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize("algorithm", ["twolevel_shard", "twolevel_leader"])
def test_inner_dense_with_a_quantizer_is_refused_on_every_rank_before_any_data(
    algorithm: str, nodes: int, per: int
) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(nodes * per, per))
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        try:
            sparse_allreduce(s, comm, algorithm=algorithm, inner="dense", quantizer="qsgd",
                             quantize="contributions")  # fmt: skip
        except ValueError as e:
            return type(e).__name__, str(e)
        return "no error", ""

    for kind, msg in run_ranks(nodes * per, fn, timeout=10):
        assert kind == "ValueError" and "inner='dense'" in msg, msg


def test_a_subgroup_finds_its_nodes_in_its_parents_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # a group of one rank per node spans nodes, whatever its size; the world's
    # SPARCML_RANKS_PER_NODE was applied to the group's own ranks (2 ranks "cannot form
    # nodes of 4"), and in-process groups always reported one node
    def fn(comm):  # type: ignore[no-untyped-def]
        lane = comm.subgroup([comm.rank % 4, comm.rank % 4 + 4])
        node = comm.subgroup(list(range(comm.rank // 4 * 4, comm.rank // 4 * 4 + 4)))
        odd = comm.subgroup([0, 1, 4] if comm.rank in (0, 1, 4) else [2, 3, 5, 6, 7])
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        total = sparse_allreduce(s, lane).to_dense().sum().item()
        return lane.topology.nodes, node.topology.nodes, odd.topology.is_flat, total

    monkeypatch.setenv("SPARCML_RANKS_PER_NODE", "4")
    for lane, node, flat, total in run_ranks(8, fn, timeout=20):
        assert lane == ((0,), (1,)) and node == ((0, 1, 2, 3),) and flat and total == 2.0
    monkeypatch.delenv("SPARCML_RANKS_PER_NODE")

    def explicit(comm):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(4, 2))
        return comm.subgroup([0, 2] if comm.rank in (0, 2) else [1, 3]).topology.nodes

    assert run_ranks(4, explicit) == [((0,), (1,))] * 4


def _nodes_to_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process ranks that find their nodes (two ranks each) by gathering node keys,
    as ranks on several hosts without SPARCML_RANKS_PER_NODE do."""
    from sparcml.comm.local import LocalCommunicator

    for var in ("SPARCML_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(LocalCommunicator, "one_process", False)
    monkeypatch.setattr(LocalCommunicator, "node_key", lambda self: f"node{self.rank // 2}")


def test_nodes_are_not_gathered_before_the_header_shows_the_same_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # auto on some ranks, a flat algorithm on the others: gathering the node keys
    # before the header (to fingerprint the layout) hung until the timeout, blaming
    # a live rank; the header refuses the difference at once
    _nodes_to_gather(monkeypatch)

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        try:
            sparse_allreduce(s, comm, algorithm="auto" if comm.rank % 2 else "ssar_split_allgather")
        except RankMismatchError as e:
            return str(e)
        return "no error"

    for msg in run_ranks(4, fn, timeout=5):
        assert "different algorithm settings" in msg, msg
    twice = run_ranks(4, lambda c: [sparse_allreduce(  # the nodes gathered, then known
        SparseStream(torch.tensor([c.rank]), torch.tensor([1.0]), 8), c).to_dense().tolist()
        for _ in range(2)] + [c.topology.nodes], timeout=10)  # fmt: skip
    assert all(t == [[1.0] * 4 + [0.0] * 4] * 2 + [((0, 1), (2, 3))] for t in twice), twice


def test_a_group_of_a_group_finds_its_nodes_without_messages_on_its_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ranks 0 and 1 alone ask a group of a group for its nodes: the middle group's
    # nodes were gathered on it, among ranks (2) that never asked: a timeout
    _nodes_to_gather(monkeypatch)

    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 3:
            return None
        mid = comm.subgroup((0, 1, 2))
        return None if comm.rank == 2 else mid.subgroup((0, 1)).topology.nodes

    assert run_ranks(4, fn, timeout=5) == [((0, 1),), ((0, 1),), None, None]
