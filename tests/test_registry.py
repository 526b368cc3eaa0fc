"""The algorithm registry is the one place that knows an algorithm.

A throwaway registration (a new file's worth: a function, its cost, its facts)
is picked up by ``sparse_allreduce``, ``auto``, the simulator and the benchmarks'
algorithm lists without touching any other module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from sparcml import CostModel, SparseStream, sparse_allreduce
from sparcml.collectives import choose_algorithm, registry
from sparcml.collectives.autotune import choose
from sparcml.collectives.codec import EXACT, StreamCodec
from sparcml.collectives.registry import algorithm_info, algorithms, predict, register
from sparcml.collectives.topka import topka
from sparcml.comm import Communicator, run_ranks
from sparcml.tools.bench.topk import topk_algorithms
from sparcml.tools.simulate import SimConfig, default_algorithms, run_simulation


def flat_auto() -> list[str]:
    """``auto``'s candidates on ranks of one node (the two-level ones need several)."""
    return [a for a in algorithms(auto=True) if not algorithm_info(a).two_level]


def test_every_registration_carries_its_facts() -> None:
    for name in algorithms():
        info = algorithm_info(name)
        assert info.input in registry.INPUTS and info.family <= set(registry.FAMILIES)
        assert info.cost is not None, f"{name} has no cost formula"
        assert predict(CostModel(), name, 4, 1000, [10] * 4, 4) > 0
        if info.auto:
            assert info.exact and info.input == "stream"
    assert algorithm_info("topkdsa").alias_of == "ssar_split_allgather"
    assert algorithms(auto=True, variants=False) == sorted(
        ["dense", "dsar_split_allgather", "ssar_recursive_double", "ssar_split_allgather",
         "twolevel_leader", "twolevel_shard"]
    )  # fmt: skip
    two_level = [a for a in algorithms(variants=False) if algorithm_info(a).two_level]
    assert two_level == ["twolevel_leader", "twolevel_shard"]
    variants = {
        a: algorithm_info(a).variant_of for a in algorithms() if algorithm_info(a).variant_of
    }
    assert variants == {
        f"{base}+{inner}": base
        for base in two_level
        for inner in ("ssar_split_allgather", "dsar_split_allgather")
    }
    for name, base in variants.items():
        v, b = algorithm_info(name), algorithm_info(base)
        assert (v.auto, v.two_level, v.auto_priority, v.exact) == (
            b.auto,
            b.two_level,
            b.auto_priority,
            b.exact,
        )
        assert v.options == () and name.split("+")[1] in v.summary
    assert set(topk_algorithms()) == {"dense", "topka", "topkdsa", "gtopk", "gaussiank", "oktopk"}


def test_ties_follow_auto_priority() -> None:
    # at P = 1 every prediction is 0: recursive doubling (priority 0) wins
    assert choose(CostModel(), 1, 100, [3], 4) == "ssar_recursive_double"


def _cost_of(seconds: float):  # type: ignore[no-untyped-def]
    """A cost formula that predicts ``seconds`` whatever the call."""

    def cost(model: CostModel, p: int, n: int, ks: Sequence[int], isize: int) -> float:
        return seconds

    return cost


_free_cost = _cost_of(1e-12)  # cheaper than anything: auto must pick it


@pytest.fixture
def throwaway() -> Iterator[str]:
    name = "throwaway_allgather_sum"

    @register(name, auto=True, cost=_free_cost, quadratic=True)
    def throwaway_allgather_sum(
        stream: SparseStream, comm: Communicator | None = None, codec: StreamCodec = EXACT
    ) -> SparseStream:
        """TopkA's allgather, registered again under another name."""
        return topka(stream, comm, codec)

    try:
        yield name
    finally:
        del registry._REGISTRY[name]


def test_a_new_registration_is_picked_up_everywhere(throwaway: str) -> None:
    assert throwaway in algorithms(exact=True) and throwaway in default_algorithms()

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        auto = sparse_allreduce(s, comm, cost_model=CostModel())
        named = sparse_allreduce(s, comm, algorithm=throwaway)
        assert choose_algorithm(s, comm, CostModel()) == throwaway
        return auto.to_dense(), named.to_dense()

    for auto, named in run_ranks(3, fn):
        assert torch.equal(auto, named) and auto.tolist()[:3] == [1.0, 1.0, 1.0]
    row = run_simulation(
        SimConfig(
            world_sizes=(4,), size=4096, density=0.01, algorithms=(throwaway,), progress=False
        )
    )[0]
    assert row["correct"] and row["identical_on_all_ranks"] and row["model_s"] == 1e-12


def test_auto_measures_without_calibration_and_agrees_on_the_slowest_rank(
    throwaway: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a calibration file ``auto`` times its candidates on real calls: the
    throwaway (predicted cheapest) is slow on rank 0 only, so every rank must drop it."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", math.inf)
    slow = registry._REGISTRY[throwaway]

    def slow_on_rank0(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        if comm.rank == 0:
            time.sleep(0.05)
        return topka(stream, comm, codec)

    registry._REGISTRY[throwaway] = dataclasses.replace(slow, fn=slow_on_rank0)

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank, 5]), torch.tensor([1.0, 2.0]), 8)
        n = len(flat_auto()) * autotune.ROUNDS
        outs = [sparse_allreduce(s, comm).to_dense() for _ in range(n)]
        while autotune.measuring(comm):  # (a close call's extra rounds)
            outs.append(sparse_allreduce(s, comm).to_dense())
        outs.append(sparse_allreduce(s, comm).to_dense())
        (choice,) = autotune.auto_choices(comm)
        return outs, choice.winner, choice.agreed, choose_algorithm(s, comm)

    got = run_ranks(3, fn)
    for outs, winner, agreed, chosen in got:
        assert all(o.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 6.0, 0.0, 0.0] for o in outs)
        assert winner == chosen == got[0][1] and winner != throwaway
        assert agreed == got[0][2]  # the same figures on every rank
    # with a calibration file the model decides (and picks the free throwaway)
    cal = CostModel().save(tmp_path / "cal.json")
    monkeypatch.setenv("SPARCML_CALIBRATION", str(cal))
    assert autotune.auto_mode(None) == "model"


@pytest.mark.parametrize(
    ("slow", "winner", "checks", "rechecks"),
    [(0.03, "steady", 2, 2), (0.011, "fast_then_slow", 3, 1)],
)
def test_auto_measures_a_class_again_when_its_winner_turns_slow(
    slow: float,
    winner: str,
    checks: int,
    rechecks: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Two candidates the model cannot tell apart: ``fast_then_slow`` wins the first
    measurement and the first check's measuring again (whatever the figures),
    then takes ``slow`` seconds a call against ``steady``'s 10 ms. At the second
    check (RECHECK_EVERY settled calls later) the ranks agree on its median: 30 ms
    is over RECHECK_FACTOR times the runner-up's measured time, so the two are
    measured again and ``steady`` serves; 11 ms is not, nothing is measured, and
    the winner serves on (a third check, as quiet)."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", 1.0)  # only the two free candidates
    monkeypatch.setattr(autotune, "CLOSE_FACTOR", 1.0)  # (not about close calls)
    monkeypatch.setattr(autotune, "RECHECK_EVERY", 4)
    slow_now: dict[int, bool] = {}

    @register("fast_then_slow", auto=True, cost=_free_cost, auto_priority=-2)
    def fast_then_slow(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        if slow_now.get(comm.rank):
            time.sleep(slow)
        return topka(stream, comm, codec)

    @register("steady", auto=True, cost=_free_cost, auto_priority=-1)
    def steady(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        return topka(stream, comm, codec)

    try:

        def fn(comm):  # type: ignore[no-untyped-def]
            s = SparseStream(torch.tensor([comm.rank, 5]), torch.tensor([1.0, 2.0]), 8)
            first = 2 * autotune.ROUNDS  # a measurement of the two
            every = autotune.RECHECK_EVERY
            outs = [sparse_allreduce(s, comm).to_dense() for _ in range(first + every + first)]
            (choice,) = autotune.auto_choices(comm)
            before = (choice.winner, choice.checks, choice.rechecks)
            slow_now[comm.rank] = True
            outs += [sparse_allreduce(s, comm).to_dense() for _ in range(every + first + 2)]
            return outs, before, (choice.winner, choice.checks, choice.rechecks)

        for outs, before, after in run_ranks(2, fn):
            assert all(o.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0] for o in outs)
            assert before == ("fast_then_slow", 1, 1)
            assert after == (winner, checks, rechecks)
    finally:
        del registry._REGISTRY["fast_then_slow"], registry._REGISTRY["steady"]


def test_auto_measures_small_calls_on_nodes_and_leaves_them_to_the_model_on_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The model predicts both throwaways far under MEASURE_ABOVE_S and picks
    ``looks_small``, which takes 20 ms on one rank. On one node the small call is
    the model's: ``looks_small`` runs every call, ``is_small`` never. On 2 nodes of
    2 ranks the class is measured (the slowest rank's times agreed) and settles on
    ``is_small``; every result exact."""
    from sparcml.collectives import autotune
    from sparcml.comm.topology import Topology

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", 2.0)  # only the two throwaways
    ran: dict[str, int] = {"looks_small": 0, "is_small": 0}

    @register("looks_small", auto=True, cost=_cost_of(1e-9))
    def looks_small(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        ran["looks_small"] += comm.rank == 0
        time.sleep(0.02 if comm.rank == 1 else 0.0)  # slow on one rank: max decides
        return topka(stream, comm, codec)

    @register("is_small", auto=True, cost=_cost_of(2e-9))
    def is_small(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        ran["is_small"] += comm.rank == 0
        return topka(stream, comm, codec)

    def fn(comm, nodes):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(4, 4 // nodes))
        s = SparseStream(torch.tensor([comm.rank, 5]), torch.tensor([1.0, 2.0]), 8)
        outs = [sparse_allreduce(s, comm).to_dense() for _ in range(6)]
        return outs, [(c.candidates, c.winner) for c in autotune.auto_choices(comm)]

    want = [1.0, 1.0, 1.0, 1.0, 0.0, 8.0, 0.0, 0.0]
    try:
        for outs, choices in run_ranks(4, lambda comm: fn(comm, 1)):
            assert all(o.tolist() == want for o in outs) and choices == []
        assert ran == {"looks_small": 6, "is_small": 0}
        ran.update(looks_small=0, is_small=0)
        for outs, choices in run_ranks(4, lambda comm: fn(comm, 2)):
            assert all(o.tolist() == want for o in outs)
            assert choices == [(["looks_small", "is_small"], "is_small")]
        n = autotune.ROUNDS
        assert ran == {"looks_small": n, "is_small": n + 6 - 2 * n}
    finally:
        del registry._REGISTRY["looks_small"], registry._REGISTRY["is_small"]


@contextlib.contextmanager
def _changing_and_steady(first: float, later: float, steady: float) -> Iterator[None]:
    """Two throwaway candidates the model ranks ``changing`` then ``steady`` (both
    free): ``changing`` sleeps ``first`` seconds in each rank's first ROUNDS calls,
    then ``later``; ``steady`` sleeps ``steady`` seconds every call."""
    from sparcml.collectives import autotune

    calls: dict[int, int] = {}

    @register("changing", auto=True, cost=_cost_of(1e-9))
    def changing(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        calls[comm.rank] = calls.get(comm.rank, 0) + 1
        time.sleep(first if calls[comm.rank] <= autotune.ROUNDS else later)
        return topka(stream, comm, codec)

    @register("steady", auto=True, cost=_cost_of(1.5e-9))
    def steady_fn(stream, comm=None, codec=EXACT):  # type: ignore[no-untyped-def]
        time.sleep(steady)
        return topka(stream, comm, codec)

    try:
        yield
    finally:
        del registry._REGISTRY["changing"], registry._REGISTRY["steady"]


def _exact_call(comm: Communicator) -> None:
    s = SparseStream(torch.tensor([comm.rank, 5]), torch.tensor([1.0, 2.0]), 8)
    assert sparse_allreduce(s, comm).to_dense().tolist() == [
        1.0, 1.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("first", "later", "steady", "expected"),
    [
        (0.042, 0.010, 0.040, "changing"),
        (0.040, 0.060, 0.044, "steady"),
        (0.044, 0.041, 0.040, "steady"),
    ],
    ids=["later-rounds-decide", "a-slower-median-loses", "close-medians"],
)
def test_auto_measures_a_close_call_for_more_rounds(
    first: float,
    later: float,
    steady: float,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``changing`` and ``steady`` within CLOSE_FACTOR after ROUNDS rounds: the two
    run CLOSE_ROUNDS more rounds each and the median of all of a candidate's rounds
    decides. First case: ``changing`` 42 ms against 40 ms, then 10 ms: its median
    26 ms wins (ROUNDS alone would pick ``steady``). Second: 40 ms against 44 ms,
    then 60 ms: ``changing``'s best round is the faster, its median (50 ms) the
    slower, and ``steady`` wins (a best-of would have picked ``changing``). Third:
    44 then 41 ms against 40 ms every call: ``steady``."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", 2.0)

    def fn(comm):  # type: ignore[no-untyped-def]
        _exact_call(comm)
        (choice,) = autotune.auto_choices(comm)
        other = dataclasses.replace(choice.cls, size=choice.cls.size + 1)
        assert autotune.measuring(comm, choice.cls) and not autotune.measuring(comm, other)
        n = 1
        while autotune.measuring(comm):
            _exact_call(comm)
            n += 1
        return n, choice.winner, choice.extended, choice.runner_up, choice.runner_up_s

    other = "steady" if expected == "changing" else "changing"
    with _changing_and_steady(first, later, steady):
        for n, winner, extended, runner_up, runner_up_s in run_ranks(2, fn):
            assert n == 2 * (autotune.ROUNDS + autotune.CLOSE_ROUNDS)
            assert (winner, extended, runner_up) == (expected, True, other)
            # the figure the runner-up lost on: the median of its rounds
            lost_on = steady if other == "steady" else (first + later) / 2
            assert lost_on <= runner_up_s < 1.5 * lost_on


def test_auto_measures_the_two_again_once_the_process_has_settled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``changing`` takes 2 ms in its first ROUNDS calls, then 20 ms; ``steady`` 14
    ms. The first measurement picks ``changing``; its later 20 ms are under
    RECHECK_FACTOR times ``steady``'s 14 ms, so only the first check's measuring
    of the two again (whatever the figures) finds ``steady`` faster."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", 2.0)
    monkeypatch.setattr(autotune, "RECHECK_EVERY", 3)

    def fn(comm):  # type: ignore[no-untyped-def]
        first = 2 * autotune.ROUNDS
        for _ in range(first):
            _exact_call(comm)
        (choice,) = autotune.auto_choices(comm)
        then = choice.winner
        for _ in range(autotune.RECHECK_EVERY + first):
            _exact_call(comm)
        while autotune.measuring(comm):  # (a close call's extra rounds)
            _exact_call(comm)
        return then, choice.winner, choice.rechecks, choice.checks

    with _changing_and_steady(0.002, 0.020, 0.014):
        for then, now, rechecks, checks in run_ranks(2, fn):
            assert (then, now, rechecks, checks) == ("changing", "steady", 1, 1)


def test_auto_measures_a_neighbouring_density_on_two_candidates_at_most(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A class one density step from a measured one tries only the model's best and
    the neighbour's winner."""
    from sparcml.collectives import autotune

    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "absent.json"))
    monkeypatch.setattr(autotune, "MEASURE_ABOVE_S", 0.0)
    monkeypatch.setattr(autotune, "PRUNE_FACTOR", math.inf)

    def fn(comm):  # type: ignore[no-untyped-def]
        for nnz in (4, 8):  # densities 4/1024 and 8/1024: neighbouring classes
            idx = torch.arange(nnz) * 64 + comm.rank
            s = SparseStream(idx, torch.ones(nnz), 1024)
            while True:
                sparse_allreduce(s, comm)
                if not autotune.measuring(comm):
                    break
        return [len(c.candidates) for c in autotune.auto_choices(comm)]

    # the second class measures at most two candidates, or none at all when the
    # neighbour's winner is the model's best (one candidate: nothing to measure)
    for counts in run_ranks(3, fn):
        assert counts[0] == len(flat_auto()) and len(counts) in (1, 2)
        assert len(counts) == 1 or counts[1] <= 2
