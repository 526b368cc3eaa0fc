"""Checkpoints written before the typed configs (format version 2, prefixed option
names such as ``oktopk_tau``) load into today's states and continue bitwise.

``tests/data/checkpoints_v2.pt`` was written by the code of commit a7c5a1f (2
in-process ranks, 3 steps, ``state_dict()``, then 2 more steps recorded), with
``SPARCML_AUTO=model`` so that ``auto`` picks by the cost model alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparcml.comm import run_ranks
from sparcml.torch import LayerRule, SparcmlState
from sparcml.torch.reduce import Bucket, reduce_bucket

DATA = Path(__file__).parent / "data" / "checkpoints_v2.pt"
SIZES = (300, 7, 1200, 40)
NAMES = ("a.weight", "a.bias", "b.weight", "b.bias")
#: today's options for the runs the file holds (its options had the old names)
CASES = {
    "topk_reuse": ("threshold_reuse", {"density": 0.05}),
    "oktopk": ("oktopk", {"density": 0.05, "tau": 3, "tau_prime": 2}),
    "redsync_asq": ("redsync", {"density": 0.05, "min_bytes": 0, "asq": True}),
    # (made when momentum factor masking was on by default: on, by name)
    "topk_natural_rules": (
        "topk+natural",
        {
            "density": 0.05,
            "momentum": 0.9,
            "momentum_masking": True,
            "layers": [("*.bias", "dense")],
        },
    ),
    "qsgd": ("qsgd", {}),
    "rule_options": (
        "topk",
        {"density": 0.05, "layers": [LayerRule("oktopk", pattern="b.*", options={"tau": 3})]},
    ),
}


def _grads(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(sum(SIZES), generator=g)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_version_2_checkpoint_loads_and_continues_bitwise(case: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_AUTO", "model")
    monkeypatch.setenv("SPARCML_CALIBRATION", "/nonexistent/sparcml/calibration.json")
    saved = torch.load(DATA, weights_only=True)[case]
    method, options = CASES[case]
    assert saved["method"] == method
    assert saved["ranks"][0]["state_dict"]["version"] == 2

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState(method, comm=comm, **options)
        state.load_state_dict(saved["ranks"][comm.rank]["state_dict"])  # strict
        return [reduce_bucket(state, Bucket(NAMES, SIZES, _grads(comm.rank, t), t)) for t in (3, 4)]

    for rank, got in enumerate(run_ranks(2, fn)):
        for t, (mine, theirs) in enumerate(zip(got, saved["ranks"][rank]["after"], strict=True)):
            assert torch.equal(mine, theirs), (case, rank, 3 + t)


def test_a_version_2_checkpoint_of_other_settings_is_refused_naming_them() -> None:
    saved = torch.load(DATA, weights_only=True)["oktopk"]["ranks"][0]["state_dict"]

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("oktopk", density=0.05, tau=4, tau_prime=2, comm=comm)
        if comm.rank == 0:
            with pytest.raises(ValueError, match=r"tau \(checkpoint: 3, this state: 4\)"):
                state.load_state_dict(saved)

    run_ranks(2, fn)


def test_a_checkpoint_made_under_the_old_masking_default_names_it() -> None:
    """Momentum factor masking was on by default when the file was written; today
    it is off. Where momentum correction ran, a state built with today's default
    refuses the checkpoint naming the setting; where it did not (every other
    case above), the setting changes nothing and the checkpoint loads."""
    saved = torch.load(DATA, weights_only=True)["topk_natural_rules"]["ranks"][0]["state_dict"]

    def fn(comm):  # type: ignore[no-untyped-def]
        state = SparcmlState("topk+natural", density=0.05, momentum=0.9, comm=comm,
                             layers=[("*.bias", "dense")])  # fmt: skip
        if comm.rank == 0:
            with pytest.raises(
                ValueError, match=r"momentum_masking \(checkpoint: True, this state: False\)"
            ):
                state.load_state_dict(saved)

    run_ranks(2, fn)


def test_a_refused_load_leaves_the_state_as_it_was() -> None:
    """An audit found load_state_dict(strict=False) raising on the layer rules' count
    only after it had set the step counter and the call numbering: a caller who
    caught the error went on with a shifted warm-up. Refused now before anything is
    assigned."""
    from sparcml.comm import SelfCommunicator

    ruled = SparcmlState("topk", 0.1, comm=SelfCommunicator(), layers=[("*.bias", "dense")])
    ruled.step, ruled.comm.sequence = 3, 3
    saved = ruled.state_dict()
    plain = SparcmlState("topk", 0.1, comm=SelfCommunicator())
    with pytest.raises(ValueError, match="1 layer rule groups, this state has 0"):
        plain.load_state_dict(saved, strict=False)
    assert plain.step == 0 and plain.comm.sequence == 0


def test_a_checkpoint_of_other_settings_loaded_leniently_runs_this_states_method() -> None:
    """``load_state_dict(sd, strict=False)`` is for a deliberate change of settings:
    the saved operators were restored too, and only rebuilt on another density, so
    a ``qsgd`` state kept the checkpoint's natural compression and ``topk+natural``
    a bare top-k (nothing quantized). Residuals and momenta are kept; the operators
    and the method's runtime state start afresh."""
    from sparcml.compress.natural import NaturalCompression
    from sparcml.compress.qsgd import QSGD

    key = ("fsdp", "layer")
    a = SparcmlState("natural")
    a.groups[0].operator(key)
    a.groups[0].feedback.buffers = {"layer": torch.ones(3)}
    b = SparcmlState("qsgd")
    b.load_state_dict(a.state_dict(), strict=False)
    assert isinstance(b.groups[0].operator(key), QSGD)
    assert torch.equal(b.groups[0].feedback.buffers["layer"], torch.ones(3))
    c = SparcmlState("natural")  # the same settings: operators restored as saved
    c.load_state_dict(a.state_dict())
    assert isinstance(c.groups[0].operator(key), NaturalCompression)
    t = SparcmlState("topk", density=0.01)
    t.groups[0].operator(key)
    tn = SparcmlState("topk+natural", density=0.01)
    tn.load_state_dict(t.state_dict(), strict=False)
    assert type(tn.groups[0].operator(key)).__name__ == "Composed"
