"""Failure semantics users can rely on (issue 18): errors keep their type through the
DDP hook and DistributedOptimizer, name the rank that actually failed, and misuse
(mismatched settings, skipped calls, no process group, NaN with a quantizer) fails
on every rank at once.

The spawned-gloo cases run one or two fault runs each; ``sparcml bench-faults``
runs the 10-run statistics (see docs/failures.md).
"""

from __future__ import annotations

import time

import pytest
import torch

import failure_workers as fw
import sparcml
from sparcml import SparseStream, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.comm.launch import run_processes
from sparcml.errors import CommError, CommTimeoutError, RankMismatchError
from sparcml.tools.bench.faults import run_fault
from sparcml.torch import SparcmlState
from sparcml.torch.reduce import Bucket, reduce_bucket

DOCUMENTED = {"PeerFailedError", "CommTimeoutError"}


# --------------------------------------------------------------- in-process / no ranks
def test_comm_errors_are_torch_dist_errors() -> None:
    import torch.distributed as dist

    e = CommTimeoutError("x", peer=3)
    assert isinstance(e, dist.DistError) and isinstance(e, TimeoutError)
    assert isinstance(e, CommError) and isinstance(e, RuntimeError) and e.peer == 3


@pytest.mark.parametrize("var", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_entry_points_refuse_a_silent_world_of_one(
    monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, "2")
    s = SparseStream.dense(torch.ones(4))
    with pytest.raises(RuntimeError, match=f"started 2 ranks \\({var}=2\\)"):
        sparse_allreduce(s)
    with pytest.raises(RuntimeError, match="no communicator connects them"):
        sparcml.torch.topk_sgd_step(torch.ones(4), "w", sparcml.ErrorFeedback(), k=1)
    with pytest.raises(RuntimeError, match="no communicator connects them"):
        SparcmlState("topk")
    monkeypatch.setenv(var, "1")
    assert sparse_allreduce(s).to_dense().tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("method", "algorithm", "match"),
    [
        ("topk", "oktopk", "Ok-Topk is a method of its own"),
        ("topk", "gaussiank", "cannot run method 'topk'"),
        ("topk+qsgd", "dense", "cannot run method 'topk\\+qsgd'"),
        ("nonzeros", "gtopk", "cannot run method 'nonzeros'"),
        ("qsgd", "topka", "does not apply to method 'qsgd'"),
        ("oktopk", "ssar_split_allgather", "does not apply"),
        ("topk", "ring", "unknown sparse allreduce algorithm"),
    ],
)
def test_unworkable_method_algorithm_pairs_fail_at_construction(
    method: str, algorithm: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match) as info:
        SparcmlState(method, algorithm=algorithm)
    assert "valid choices" in str(info.value) or "leave algorithm='auto'" in str(info.value)


def test_workable_pairs_are_accepted() -> None:
    for method, algorithm in [("topk", "gtopk"), ("topk+qsgd", "topka"), ("nonzeros", "dense")]:
        SparcmlState(method, algorithm=algorithm)


NAN_METHODS = [
    "dense", "nonzeros", "topk", "randomk", "topk+qsgd", "topk+natural", "oktopk",
    "redsync", "qsgd", "natural", "natural_dithering", "dithering",
]  # fmt: skip


@pytest.mark.parametrize("method", NAN_METHODS)
def test_nan_policy_is_the_same_for_every_method(method: str) -> None:
    """propagate: the dense average (NaN/Inf where dense has them) on every rank, residuals
    untouched; raise: the same FloatingPointError on every rank."""
    n = 40

    def fn(comm, policy):  # type: ignore[no-untyped-def]
        extra = {"min_bytes": 0} if method == "redsync" else {}
        state = SparcmlState(method, density=0.25, comm=comm, nan_policy=policy, **extra)
        g = torch.arange(n, dtype=torch.float32) + comm.rank
        if comm.rank == 1:
            g[7] = float("nan")
        if comm.rank == 2:
            g[9] = float("inf")
        try:
            out = reduce_bucket(state, Bucket(("a", "b"), (20, 20), g, 0))
        except FloatingPointError as e:
            return str(e)
        return out, {k: v.clone() for k, v in state.residuals.items()}

    for got, residuals in run_ranks(3, fn, "propagate"):
        assert torch.isnan(got[7]) and got[9] == float("inf")
        ref = (3 * torch.arange(n, dtype=torch.float32) + 3) / 3
        keep = [i for i in range(n) if i not in (7, 9)]
        assert torch.allclose(got[keep], ref[keep])
        assert all(bool(torch.isfinite(r).all()) for r in residuals.values())
    msgs = run_ranks(3, fn, "raise")
    assert all(isinstance(m, str) and "rank(s) [1, 2]" in m for m in msgs), msgs


def test_nan_with_a_quantizer_fails_on_every_rank_at_once() -> None:
    out = run_ranks(3, fw.quantizer_nan)
    for o in out:
        # NonFiniteError from the header exchange, not CommTimeoutError: no rank waits
        assert o["type"] == "NonFiniteError" and "rank(s) [2]" in o["message"], o


def test_a_call_number_mismatch_fails_on_every_rank() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 1:
            comm.next_sequence()  # a call the others did not make
        try:
            sparse_allreduce(SparseStream.dense(torch.ones(4)), comm)
        except RankMismatchError as e:
            return str(e)
        return None

    for m in run_ranks(3, fn):
        assert m is not None and "rank 1: call number 2" in m and "rank 0: call number 1" in m


def test_settings_mismatch_names_ranks_and_settings_in_process() -> None:
    from sparcml.torch.hook import check_settings

    def fn(comm):  # type: ignore[no-untyped-def]
        method = "oktopk" if comm.rank == 1 else "topk"
        state = SparcmlState(method, density=0.1 if comm.rank == 2 else 0.01, comm=comm)
        try:
            check_settings(state)
        except RankMismatchError as e:
            return str(e)
        return None

    for m in run_ranks(3, fn):
        assert m is not None and "ranks [1, 2]" in m
        assert "method (rank 0: 'topk', rank 1: 'oktopk')" in m
        assert "density (rank 0: 0.01, rank 2: 0.1)" in m


# --------------------------------------------------------------- spawned gloo ranks
@pytest.mark.spawn
def test_hook_errors_keep_their_type_through_ddp() -> None:
    out = run_processes(2, fw.ddp_nan, "topk", "raise", timeout=20)
    for o in out:
        assert o["steps"] == 2, o
        (err,) = o["errors"]
        assert err["type"] == "FloatingPointError" and "rank(s) [1]" in err["message"], err
    # propagate: no error, the step's gradient is non-finite on every rank like dense DDP
    out = run_processes(2, fw.ddp_nan, "qsgd", "propagate", timeout=20)
    for o in out:
        assert o["steps"] == 3 and "errors" not in o, o
        assert not bool(torch.isfinite(o["grads"][1]).all())
        assert bool(torch.isfinite(o["grads"][2]).all())


@pytest.mark.spawn
def test_ranks_configured_differently_fail_registration_on_every_rank() -> None:
    hyper = [
        {"method": "topk", "density": 0.01},
        {"method": "oktopk", "density": 0.01},
        {"method": "topk", "density": 0.05},
    ]
    out = run_processes(3, fw.register_mismatch, hyper, timeout=20)
    for o in out:
        assert o["type"] == "RankMismatchError", o
        assert "ranks [1, 2]" in o["message"] and "'oktopk'" in o["message"]
        assert "density (rank 0: 0.01, rank 2: 0.05)" in o["message"]


@pytest.mark.spawn
@pytest.mark.parametrize("api", ["register", "comm_hook"])
@pytest.mark.parametrize(
    "bad", [{"method": "topkk"}, {"density": 0}, {"compressor_params": {"bogus": 1}}]
)
def test_a_rank_that_refuses_its_arguments_is_named_by_every_rank_at_once(
    api: str, bad: dict
) -> None:
    """An audit found: a bad method or option on one rank only (a per-rank config)
    raised ValueError there at once, while the others waited in the state's new
    process group for their whole timeout and then got torch's DistStoreError,
    naming no rank. Now every rank checks in through the rendezvous store before the
    group is created (the pair's rank when the pair is made), and the others raise
    RankMismatchError naming the rank and its error, at once."""
    out = run_processes(3, fw.refused_on_one_rank, api, bad, timeout=60)
    assert out[1]["type"] == "ValueError", out[1]
    for r in (0, 2):
        assert out[r]["type"] == "RankMismatchError", out[r]
        assert "rank(s) [1] could not build their SparcmlState" in out[r]["message"]
        assert out[1]["message"] in out[r]["message"]
        assert out[r]["seconds"] < 10, out[r]


@pytest.mark.spawn
@pytest.mark.parametrize("api", ["register", "comm_hook", "from_config"])
def test_a_config_missing_on_one_rank_is_named_by_every_rank_at_once(api: str) -> None:
    """An audit found: a config file that one rank cannot read (missing on its node)
    raised FileNotFoundError there before any state was built, and noted nothing,
    so the others waited out their timeout in the check-in. Now the rank notes it
    as its refusal and the others raise RankMismatchError naming it, at once."""
    missing = {"method": "/nonexistent/sparcml-config.yaml"}
    out = run_processes(3, fw.refused_on_one_rank, api, missing, timeout=60)
    assert out[1]["type"] == "FileNotFoundError", out[1]
    for r in (0, 2):
        assert out[r]["type"] == "RankMismatchError", out[r]
        assert "rank(s) [1] could not build their SparcmlState" in out[r]["message"]
        assert "sparcml-config.yaml" in out[r]["message"], out[r]
        assert out[r]["seconds"] < 10, out[r]


@pytest.mark.spawn
def test_a_rank_that_never_builds_its_state_is_named_at_the_timeout() -> None:
    """The check-in's other half: a rank that neither builds nor refuses its state
    in time (another program, or late) is named by a CommTimeoutError at the
    builders' timeout, not by torch's DistStoreError from inside new_group."""
    out = run_processes(3, fw.absent_from_construction, 2, timeout=60)
    for r in (0, 1):  # (the first to time out names rank 2; the other may learn it so)
        assert out[r]["type"] == "CommTimeoutError" and out[r]["peer"] == 2, out[r]
        assert "[2]" in out[r]["message"] and "SparcmlState" in out[r]["message"], out[r]
    # arriving after they gave up, it learns why at once instead of waiting alone in
    # the group's creation (they noted that they gave up)
    assert out[2]["type"] == "CommTimeoutError" and out[2]["peer"] == 2, out[2]
    assert "timed out waiting for ranks" in out[2]["message"] and out[2]["seconds"] < 2


@pytest.mark.spawn
def test_a_rank_that_skips_a_step_fails_on_every_rank_with_call_ids() -> None:
    out = run_processes(3, fw.skip_a_step, True, timeout=20)
    for o in out:
        err = o[-1]
        assert isinstance(err, dict) and err["type"] == "RankMismatchError", o
        assert "rank 1: call_id 2" in err["message"] and "rank 0: call_id 1" in err["message"]


@pytest.mark.spawn
def test_without_call_ids_a_skipped_step_goes_unseen_and_mixes_steps() -> None:
    """What call_id is for: the call counts agree (a skip plus an extra call), so
    without it the calls pair up by position and the sums mix steps (documented)."""
    out = run_processes(3, fw.skip_a_step, False, timeout=20)
    # call c sums step c of ranks 0 and 2 with step [0, 2, 3][c] of rank 1
    mixed = [[float(a + b + a)] * 4 for a, b in zip([0, 1, 2], [0, 2, 3], strict=True)]
    for o in out:
        assert o == mixed, o


@pytest.mark.spawn
@pytest.mark.parametrize("algorithm", ["dense", "ddp-dense"])
def test_dense_collective_timeouts_name_the_absent_rank(algorithm: str) -> None:
    out = run_processes(3, fw.dense_timeout, 2, algorithm, timeout=3, deadline=60, only=[0, 1])
    for o in out[:2]:
        assert o["type"] == "CommTimeoutError" and o["peer"] == 2, o


@pytest.mark.spawn
def test_a_rank_whose_code_raises_is_named_with_its_error() -> None:
    out = run_processes(4, fw.raises_inside_collective, 3, timeout=4, deadline=60, only=[0, 1, 2])
    for o in out[:3]:
        assert o["type"] in DOCUMENTED and o["peer"] == 3, o


@pytest.mark.spawn
def test_ranks_failing_at_once_raise_their_own_errors_without_waiting_for_each_other() -> None:
    # gloo completes a send once the peer posts its receive: two ranks that both fail
    # and wait for their abort notes to leave would wait until the timeout (60 s
    # here) before raising; the notes' flush is bounded (Communicator.NOTE_FLUSH_S)
    out = run_processes(3, fw.every_rank_raises, timeout=60)
    for r, o in enumerate(out):
        assert o["type"] == "KeyError" and f"on rank {r}" in o["message"], o
        assert o["seconds"] < 30, o  # half the timeout: no rank waited it out


@pytest.mark.spawn
def test_a_mismatch_one_rank_saw_is_named_to_a_rank_in_a_dense_collective() -> None:
    # rank 2 raises a mismatch only it saw; rank 0, inside gloo's own allreduce, takes
    # no abort note and times out. It must name rank 2: the mismatch was not
    # published (a type filter), so rank 0 named a live bystander, and rank 2's
    # unsent note to rank 0 was waited for until the timeout in the background,
    # closing the group's connections and publishing a verdict naming rank 0
    out = run_processes(3, fw.mismatch_seen_by_one_rank, timeout=3.0, deadline=90)
    assert out[0]["type"] == "PeerFailedError" and out[0]["peer"] == 2, out[0]
    assert "rank 2 raised RankMismatchError" in out[0]["message"], out[0]
    for o in out[1:]:
        assert o["type"] == "RankMismatchError", o


@pytest.mark.spawn
def test_an_error_every_rank_raised_is_not_blamed_for_a_later_failure() -> None:
    # a TypeError every rank raised leaves the communicator usable; its failure
    # record must not name rank 0 when rank 2 dies two calls later
    out = run_processes(
        3, fw.alike_error_then_calls, "ssar_split_allgather", 300, 2,
        timeout=3.0, deadline=90, allow_missing=True,
    )  # fmt: skip
    assert out[2] is None
    for o in out[:2]:
        assert o["first"] == "TypeError" and o["calls"] == 2, o
        assert o["error"]["type"] == "PeerFailedError" and o["error"]["peer"] == 2, o
        assert "TypeError" not in o["error"]["message"], o


@pytest.mark.spawn
def test_abort_notes_no_peer_takes_leave_the_group_usable() -> None:
    # after a TypeError every rank raised, each rank's abort notes to the peers that
    # recursive doubling never pairs it with stay unsent; waiting for them timed out
    # in the background and closed the group's connections (calls then failed at the
    # timeout, blaming the TypeError); 40 calls 0.1 s apart outlast the 2 s timeout
    out = run_processes(
        4, fw.alike_error_then_calls, "ssar_recursive_double", 40, None,
        timeout=2.0, deadline=90,
    )  # fmt: skip
    for o in out:
        assert o["first"] == "TypeError" and o["error"] is None and o["calls"] == 40, o


@pytest.mark.spawn
@pytest.mark.parametrize(
    ("scenario", "mode", "world", "seed", "victim"),
    [
        ("collective", "kill", 4, 0, None),
        ("collective", "stop", 4, 2, None),
        ("collective:ssar_split_allgather", "stop", 3, 5, 0),  # rank 0 hosts the store
        ("collective:dense", "kill", 3, 6, 0),
        ("ddp", "kill", 3, 1, None),
        ("ddp", "stop", 3, 3, None),
        ("optimizer", "kill", 3, 4, None),
    ],
)
def test_survivors_name_the_rank_that_failed(
    scenario: str, mode: str, world: int, seed: int, victim: int | None
) -> None:
    """Every survivor raises the README's type for the fault (a kill: PeerFailedError,
    a freeze: CommTimeoutError, rank 0 included) naming the victim."""
    from sparcml.tools.bench.faults import EXPECTED

    r = run_fault(scenario, mode, world, seed, timeout=3.0, victim=victim)
    assert not r.hang and r.fault_at is not None, r
    for rank, o in r.survivors.items():
        assert o["type"] == EXPECTED[mode] and o["peer"] == r.victim, (rank, r.victim, o)


@pytest.mark.faults
@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", ["collective", "ddp", "optimizer"])
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_fault_statistics(scenario: str, mode: str) -> None:
    """Opt-in (``-m faults``): 10 runs each at P = 3 and 4; every survivor right, 0 hangs."""
    results = [
        run_fault(scenario, mode, 3 + seed % 2, seed, timeout=3.0, victim=(seed // 2) % 3)
        for seed in range(10)
    ]
    assert not any(r.hang for r in results)
    assert all(r.all_right and not r.wrong_type for r in results), [
        r for r in results if not r.all_right or r.wrong_type
    ]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("case", sorted(fw.MISMATCHES))
def test_one_setting_on_one_rank_is_refused_alike_on_every_rank(case: str, world: int) -> None:
    """Issue 34's mismatch matrix (in-process ranks, the last rank odd): every rank
    raises RankMismatchError naming the setting, none waits for its timeout (which
    would raise CommTimeoutError instead), none reports a garbage value."""
    out = run_ranks(world, fw.mismatch, case, world - 1, timeout=60)
    for r, o in enumerate(out):
        assert o["type"] == "RankMismatchError", (r, o)
        assert fw.MISMATCH_NAMES[case] in o["message"], (r, o)
    if case == "N":
        assert all(f"rank {world - 1}: N=49" in o["message"] for o in out)
    if case == "index coding":  # every coding by its name (auto was shown as "invalid")
        assert all(f"rank {world - 1}: 'delta'" in o["message"] for o in out), out
        assert all("rank 0: 'auto'" in o["message"] for o in out), out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "algorithm", ["dense", "auto", "ssar_recursive_double", "ssar_split_allgather"]
)
@pytest.mark.parametrize(
    "bad", [{"index_coding": "bogus"}, {"quantize": "bogus"}, {"unknown_option": 1}]
)
def test_a_setting_one_rank_refuses_fails_every_rank_at_once(
    world: int, algorithm: str, bad: dict
) -> None:
    """An audit found: a setting the header does not spell (without a quantizer the
    index coding and quantize mode change nothing and are not compared; option
    names are not carried) invalid on one rank only: that rank raised its
    ValueError, the others waited out their timeout in dense or auto and then
    blamed it as silent. Now the refusing rank marks its header: it raises its own
    error, every other rank RankMismatchError naming it, at once."""
    import time

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank]), torch.ones(1), 8)
        t0 = time.monotonic()
        try:
            sparse_allreduce(s, comm, algorithm=algorithm, **(bad if comm.rank == 0 else {}))
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        return "no error", "", time.monotonic() - t0

    out = run_ranks(world, fn, timeout=30)
    named = "unknown_option" if "unknown_option" in bad else "'bogus'"
    assert out[0][0] == "ValueError" and named in out[0][1], out[0]
    for kind, message, _ in out[1:]:
        assert kind == "RankMismatchError" and "rank(s) [0] refused" in message, (kind, message)
    assert all(seconds < 10 for _, _, seconds in out), out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_an_error_raised_on_one_rank_is_raised_on_every_rank(world: int) -> None:
    """The odd rank's own code raises (a broken quantizer): it raises its KeyError,
    every other rank PeerFailedError naming it and quoting the error, at once."""
    out = run_ranks(world, fw.mismatch, "raises", 1, timeout=60)
    assert out[1]["type"] == "KeyError"
    for r, o in enumerate(out):
        if r != 1:
            assert o["type"] == "PeerFailedError" and o["peer"] == 1, (r, o)
            assert "rank 1 raised KeyError" in o["message"] and "corrupt quantizer" in o["message"]


@pytest.mark.spawn
@pytest.mark.parametrize("case", ["algorithm", "algorithm (dense)", "quantizer (dense)", "raises"])
def test_over_gloo_one_rank_s_error_is_every_rank_s(case: str) -> None:
    """The same over gloo processes (3 ranks): the issue's cases that left ranks to
    wait out the timeout and blame the wrong rank."""
    out = run_processes(3, fw.mismatch, case, 2, timeout=60)
    for r, o in enumerate(out):
        if case != "raises":
            assert o["type"] == "RankMismatchError", (r, o)
        elif r == 2:
            assert o["type"] == "KeyError", o
        else:
            assert o["type"] == "PeerFailedError" and o["peer"] == 2, (r, o)


def test_a_communicator_that_lost_a_call_refuses_further_calls() -> None:
    """After a failure that left messages in flight (patterns differed), a further
    call fails at once with a clear error instead of reading a stale message."""

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([1]), torch.tensor([1.0]), 50)
        algorithm = "ssar_split_allgather" if comm.rank == 2 else "ssar_recursive_double"
        with pytest.raises(RankMismatchError):
            sparse_allreduce(s, comm, algorithm=algorithm)
        with pytest.raises(CommError, match="cannot be used after call 1 failed"):
            sparse_allreduce(s, comm)
        return True

    assert run_ranks(3, fn, timeout=60) == [True] * 3


def test_an_error_every_rank_raises_alike_leaves_the_communicator_usable() -> None:
    """Invalid arguments passed alike on every rank fail on each, before any data
    moves, and the next call works (no stale abort note fails it)."""

    def fn(comm):  # type: ignore[no-untyped-def]
        s = SparseStream(torch.tensor([comm.rank]), torch.tensor([1.0]), 8)
        with pytest.raises(ValueError, match="cannot quantize"):
            sparse_allreduce(s, comm, algorithm="dense", quantizer="qsgd")
        with pytest.raises(ValueError, match="unknown allreduce algorithm"):
            sparse_allreduce(s, comm, algorithm="nope")
        return sparse_allreduce(s, comm).to_dense().tolist()

    for got in run_ranks(3, fn, timeout=60):
        assert got == [1.0, 1.0, 1.0, 0, 0, 0, 0, 0]


def test_a_rank_in_the_next_call_follows_the_chain_into_the_last_one() -> None:
    # rank 1 waits (call 1) for rank 2, which froze; rank 0, done with call 1, waits
    # (call 2) for rank 1. Reports kept per call hid rank 1's from rank 0, which then
    # named rank 1, alive and waiting itself
    from sparcml.comm import run_ranks

    def fn(comm):  # type: ignore[no-untyped-def]
        try:
            with comm.in_call(comm.next_sequence()):
                if comm.rank == 1:
                    comm.recv(2)
                if comm.rank == 2:
                    time.sleep(6.0)  # frozen
                    return None
            with comm.in_call(comm.next_sequence()):
                if comm.rank == 0:
                    comm.recv(1)
        except CommError as e:
            return e.peer, str(e)
        return "no error"

    out = run_ranks(3, fn, timeout=2.0)
    assert out[0][0] == 2 and out[1][0] == 2, out


@pytest.mark.spawn
@pytest.mark.parametrize(
    ("api", "algorithm"),
    [
        ("sparse_allgather", ""),
        # P = 3: rank 2 folds onto rank 0, sends first and then waits for the result
        ("sparse_allreduce", "ssar_recursive_double"),
        ("sparse_allreduce", "gtopk"),
    ],
)
def test_bad_input_on_one_rank_reaches_a_rank_waiting_in_a_send_at_once(
    api: str, algorithm: str
) -> None:
    """On gloo a send completes only once the peer receives: a rank whose send waited
    before it posted its receive never read the failing peer's note, and gave up at
    its timeout (4 s here); a type check outside the ordered call sent no note."""
    out = run_processes(3, fw.bad_input_on_rank_0, api, algorithm, 5.0, timeout=4, deadline=60)
    assert out[0]["type"] == "TypeError", out[0]
    for o in out[1:]:
        assert o["type"] == "PeerFailedError" and o["peer"] == 0, o
        assert o["seconds"] < 2, o


@pytest.mark.spawn
def test_a_gtopk_child_hears_of_its_failed_parent_at_once() -> None:
    """Rank 3 sends its set to its parent, rank 2, which fails before it receives: the
    child used to wait in its send (gloo completes a send only once the peer receives)
    until its timeout; it now waits in the receive of the parent's broadcast, where
    the parent's abort note comes at once."""
    out = run_processes(4, fw.gtopk_parent_fails_first, 2, 5.0, timeout=4, deadline=60)
    assert out[2]["type"] == "KeyError", out[2]
    for o in (out[0], out[1], out[3]):
        assert o["type"] == "PeerFailedError" and o["peer"] == 2, o
        assert o["seconds"] < 2, o


@pytest.mark.spawn
def test_the_abort_records_store_connection_is_open_before_a_failure() -> None:
    """A failure reads and writes the abort record on a connection opened ahead: one
    opened only then met a store host busy with the failure (CI: a reset connection,
    retried after the client's 2 s timeout, and the failed rank named 3.3 s late)."""
    out = run_processes(3, fw.store_opened_ahead, 1, timeout=4, deadline=60)
    assert all(o["opened"] and not o["reconnected"] for o in out), out
    assert out[1]["type"] == "KeyError", out[1]
    for o in (out[0], out[2]):
        assert o["type"] == "PeerFailedError" and o["peer"] == 1, o
