"""Item 4 of the time-to-accuracy work: at density 1 every error-feedback method is
dense momentum SGD, in both arrangements a user can pick (2 spawned gloo ranks).

* DGC momentum correction (``momentum=0.9`` in the state, the optimizer without):
  ``u = m u + g`` per rank, all of ``u`` sent, so the average of the ``u`` is the
  momentum of the averaged gradient: PyTorch's ``SGD(momentum=0.9)`` on DDP's
  average, up to float rounding (sums in another order). Momentum factor masking
  (DGC sec. 3.2), on by request, zeroes ``u`` wherever it was sent: at density 1
  that is SGD without momentum, which the last test shows.
* Optimizer momentum over error feedback (PowerSGD's arrangement: the state without
  momentum, ``SGD(momentum=0.9)``): what is sent is the gradient itself.

Tolerance: 5e-6 absolute on parameters of size ~0.3-1 after 12 steps (float32 sums
in another order; measured 1.3e-6 at most); the masked run differs by ~0.3.
"""

from __future__ import annotations

import pytest
import torch

import train_workers
from sparcml.comm.launch import run_processes
from sparcml.torch.methods import method_spec
from sparcml.torch.settings import PipelineSettings
from sparcml.torch.state import methods

STEPS = 12
TOL = 5e-6
#: every method with error feedback (a density to keep the rest of)
FEEDBACK = [m for m in methods() if method_spec(m).needs_momentum_correction]
#: density 1 of each: blocktopk keeps ``per_block`` of each block whatever the density
EVERY_ENTRY = {"blocktopk": {"compressor_params": {"per_block": 512, "block": 512}}}


def test_the_error_feedback_methods_are_listed() -> None:
    assert {"topk", "oktopk", "redsync", "trimmed_topk", "randomk"} <= set(FEEDBACK)


def test_masking_is_off_by_default() -> None:
    assert PipelineSettings().momentum_masking is False


@pytest.mark.timeout(300)
def test_density_one_is_dense_momentum_sgd_in_both_arrangements() -> None:
    runs: list = [(None, {}, 0.9)]  # plain DDP, SGD with momentum: the reference
    for m in FEEDBACK:
        every = {"density": 1.0, **EVERY_ENTRY.get(m, {})}
        runs.append((m, {**every, "momentum": 0.9}, 0.0))  # momentum correction
        runs.append((m, every, 0.9))  # optimizer momentum over error feedback
    runs.append(("topk", {"density": 1.0, "momentum": 0.9, "momentum_masking": True}, 0.0))
    runs.append((None, {}, 0.0))  # plain SGD, no momentum
    both = run_processes(2, train_workers.momentum_sgd_runs, runs, STEPS, timeout=240)
    assert all(torch.equal(a, b) for a, b in zip(both[0], both[1], strict=True))
    ref, *mine = both[0]
    for (method, hyper, _), params in zip(runs[1:-2], mine[:-2], strict=True):
        where = "correction" if hyper.get("momentum") else "optimizer"
        err = float((params - ref).abs().max())
        assert err <= TOL, f"{method} ({where} momentum) at density 1: {err:.3g} from momentum SGD"
    masked, sgd = mine[-2], mine[-1]
    # masking at density 1 clears the momentum every step: plain SGD, far from momentum SGD
    assert float((masked - sgd).abs().max()) <= TOL
    assert float((masked - ref).abs().max()) > 0.05
