"""The DDP-feature matrix (docs/training.md): every feature with one sparse (topk) and
one quantized (natural) method, spawned gloo P=2, one process pair for all cells.

A cell works when training runs, the parameters stay finite and bitwise identical on
both ranks (tolerance: none), and the state counted every synchronised step.
"""

from __future__ import annotations

import pytest
import torch

import feature_workers
from sparcml.comm.launch import run_processes

pytestmark = pytest.mark.spawn
STEPS = 3
METHODS = [("topk", {"density": 0.05}), ("natural", {})]


def test_ddp_feature_matrix() -> None:
    features = list(feature_workers.FEATURES)
    out = run_processes(2, feature_workers.feature_matrix, features, METHODS, STEPS, timeout=120)
    failed = {k: v["error"] for k, v in out[0].items() if "error" in v}
    failed.update({k: v["error"] for k, v in out[1].items() if "error" in v})
    assert not failed, failed
    for key, r0 in out[0].items():
        r1 = out[1][key]
        assert torch.isfinite(r0["params"]).all(), key
        assert torch.equal(r0["params"], r1["params"]), key
        expected = STEPS + (2 if key.startswith("join/") else 0)  # rank 1's extra batches
        assert r1["step"] == expected, (key, r1["step"])
