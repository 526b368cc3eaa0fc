"""Checkpoint and resume of the compression state (SparcmlState.state_dict).

Two ranks train ``N`` steps, save model, optimizer and sparcml state per rank,
and go on ``M`` steps; fresh processes (a new process group) restore and go on
``M`` steps. Tolerance: none, the parameters must be bitwise equal, for every
method, through the DDP hook and through sync_gradients.
"""

from __future__ import annotations

import pytest
import torch

import resume_workers
import sparcml.torch as st
from sparcml.comm import SelfCommunicator
from sparcml.comm.launch import run_processes

N, M = 4, 4


@pytest.mark.spawn
def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = run_processes(2, resume_workers.first_run, str(tmp_path), N, M, timeout=120)
    again = run_processes(2, resume_workers.resumed_run, str(tmp_path), N, M, timeout=120)
    for rank in range(2):
        for key, params in first[rank].items():
            assert torch.equal(again[rank][key], params), (rank, key)
            assert torch.equal(params, first[0][key]), (rank, key)  # same on every rank
    # Restoring model and optimizer alone loses the residuals: the run differs.
    for key in ("ddp-topk", "sync-topk", "ddp-oktopk"):
        diff = float((again[0][f"{key}-nostate"] - first[0][key]).abs().max())
        assert diff > 1e-3, key


def test_state_dict_is_plain_data_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch.save(state) itself cannot work (a process group); the state_dict can."""
    state = st.SparcmlState("topk+natural", density=0.3, comm=SelfCommunicator())
    model = torch.nn.Linear(5, 3)
    for _ in range(3):
        model(torch.randn(4, 5)).sum().backward()
        st.sync_gradients(model, state)
    path = tmp_path / "s.pt"
    torch.save(state.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    fresh = st.SparcmlState("topk+natural", density=0.3, comm=SelfCommunicator())
    fresh.load_state_dict(loaded)
    assert fresh.step == 3 and fresh.residuals.keys() == state.residuals.keys()
    for k, v in state.residuals.items():
        assert torch.equal(fresh.residuals[k], v)
    other = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator())
    with pytest.raises(ValueError, match="method"):
        other.load_state_dict(loaded)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_through_distributed_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch.distributed.checkpoint: the per-rank state under a rank-keyed entry."""
    import torch.distributed.checkpoint as dcp

    from sparcml.torch.checkpoint import dcp_entry, load_dcp_entry

    state = st.SparcmlState("threshold_reuse", density=0.3, comm=SelfCommunicator())
    model = torch.nn.Linear(5, 3)
    for _ in range(3):
        model(torch.randn(4, 5)).sum().backward()
        st.sync_gradients(model, state)
    dcp.save({"model": model.state_dict(), **dcp_entry(state, 0)}, checkpoint_id=tmp_path)
    fresh = st.SparcmlState("threshold_reuse", density=0.3, comm=SelfCommunicator())
    sd = {"model": torch.nn.Linear(5, 3).state_dict(), **dcp_entry(fresh, 0)}
    dcp.load(sd, checkpoint_id=tmp_path)
    load_dcp_entry(fresh, sd, 0)
    assert fresh.step == 3
    (key,) = state.groups[0].operators
    assert fresh.groups[0].operators[key].threshold == state.groups[0].operators[key].threshold
    assert fresh.groups[0].operators[key].calls == 3
    for k, v in state.residuals.items():
        assert torch.equal(fresh.residuals[k], v)


def test_compression_stats_are_logged(caplog) -> None:  # type: ignore[no-untyped-def]
    from sparcml.torch.stats import compression_stats, log_every

    state = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator())
    model = torch.nn.Linear(5, 3)
    logged = []
    with caplog.at_level("INFO", logger="sparcml.stats"):
        for _ in range(4):
            model(torch.randn(4, 5)).sum().backward()
            st.sync_gradients(model, state)
            logged.append(log_every(state, 2, dense_bytes=72.0))
    assert logged == [False, True, False, True]
    assert "step 4" in caplog.text
    s = compression_stats(state)
    ref = torch.cat([r.reshape(-1) for r in state.residuals.values()]).double().norm()
    assert abs(s["residual_norm"] - float(ref)) < 1e-9 and s["step"] == 4


def _trained(model: torch.nn.Module, method: str = "topk", **hyper):  # type: ignore[no-untyped-def]
    state = st.SparcmlState(method, density=0.3, comm=SelfCommunicator(), **hyper)
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        st.sync_gradients(model, state)
    return state


@pytest.mark.parametrize(
    ("saved", "loading", "named"),
    [
        ({"momentum": 0.0}, {"momentum": 0.9}, "momentum"),
        (
            {"algorithm": "ssar_recursive_double"},
            {"algorithm": "ssar_split_allgather"},
            "algorithm",
        ),
        ({"error_feedback": True}, {"error_feedback": False}, "error_feedback"),
        ({"seed": 0}, {"seed": 1}, "seed"),
        ({"warmup_steps": 0}, {"warmup_steps": 3}, "warmup_steps"),
    ],
)
def test_a_checkpoint_of_other_settings_is_refused_naming_the_setting(
    saved: dict, loading: dict, named: str
) -> None:
    """Issue 34: momentum 0 vs 0.9, another algorithm, error_feedback=False and the
    rest were loaded without a word; now refused (strict) or loaded with strict=False."""
    sd = _trained(torch.nn.Linear(5, 3), **saved).state_dict()
    other = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator(), **loading)
    with pytest.raises(ValueError, match=rf"other settings: .*{named} \(checkpoint"):
        other.load_state_dict(sd)
    other.load_state_dict(sd, strict=False)  # a deliberate change: loaded, logged
    assert other.step == 2


def test_oktopk_tau_is_part_of_the_checkpoint() -> None:
    sd = _trained(torch.nn.Linear(5, 3), "oktopk", tau=64).state_dict()
    other = st.SparcmlState("oktopk", density=0.3, comm=SelfCommunicator(), tau=16)
    with pytest.raises(ValueError, match="tau"):
        other.load_state_dict(sd)


def test_a_checkpoint_of_another_model_is_refused() -> None:
    """A bigger model: refused when it is registered (before) or at registration
    (a state loaded first, as a resumed script does)."""
    sd = _trained(torch.nn.Linear(5, 3)).state_dict()
    bigger = torch.nn.Linear(5, 4)
    registered = _trained(bigger)
    with pytest.raises(ValueError, match=r"other parameters \(shapes differ: weight"):
        registered.load_state_dict(sd)
    fresh = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator())
    fresh.load_state_dict(sd)
    bigger(torch.randn(4, 5)).sum().backward()
    with pytest.raises(ValueError, match="other parameters"):
        st.sync_gradients(bigger, fresh)
    same = torch.nn.Linear(5, 3)
    again = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator())
    again.load_state_dict(sd)
    same(torch.randn(4, 5)).sum().backward()
    st.sync_gradients(same, again)  # the same shapes: no complaint


def test_a_version_1_checkpoint_still_loads() -> None:
    """Checkpoints written before settings were saved load (method and density checked)."""
    sd = _trained(torch.nn.Linear(5, 3)).state_dict()
    old = {k: v for k, v in sd.items() if k not in ("settings", "parameters")}
    old["version"] = 1
    fresh = st.SparcmlState("topk", density=0.3, comm=SelfCommunicator())
    fresh.load_state_dict(old)
    assert fresh.step == 2
    with pytest.raises(ValueError, match="method"):
        st.SparcmlState("qsgd", comm=SelfCommunicator()).load_state_dict(old)
