"""Golden regression table of the training pipeline (before/after refactors).

Every method through every entry point (the DDP hook, ``sync_gradients``, FSDP2's
reduce-scatter, ``topk_sgd_step`` / ``oktopk_sgd_step``), 6 steps of plain SGD under
fixed seeds on one spawned gloo pair (:mod:`golden_workers`): each case's bytes per
step on both ranks and the SHA-256 of the final parameters must equal
``tests/data/golden_pipeline.json`` bit for bit.

Regenerate the table (only when a change of bytes or bits is intended)::

    SPARCML_WRITE_GOLDEN=1 pytest tests/test_golden_pipeline.py

The hashes pin floating-point rounding: another torch version (other kernels) may
change them without any change in sparcml; the table records the version it was
written with and a mismatch says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import golden_workers
from sparcml.comm.launch import run_processes

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(240)]
GOLDEN = Path(__file__).parent / "data" / "golden_pipeline.json"


def _table(out: list[dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    """The ranks' results as one table (rank 0's hash, both ranks' bytes), and the
    cases that failed: raised, or left the ranks with different parameters."""
    table, bad = {}, []
    for key, r0 in out[0].items():
        r1 = out[1][key]
        if "error" in r0 or "error" in r1:
            table[key] = {"error": r0.get("error") or r1.get("error")}
            bad.append(f"{key}: raised {table[key]['error']}")
            continue
        if r0["hash"] != r1["hash"]:
            bad.append(f"{key}: rank 1's parameters differ from rank 0's")
        table[key] = {
            "step_bytes": r0["step_bytes"],
            "step_bytes_rank1": r1["step_bytes"],
            "hash": r0["hash"],
        }
    return table, bad


def _write(table: dict[str, Any]) -> None:
    meta = {
        "torch": torch.__version__,
        "world_size": 2,
        "steps": golden_workers.STEPS,
        "lr": golden_workers.LR,
        "regenerate": "SPARCML_WRITE_GOLDEN=1 pytest tests/test_golden_pipeline.py",
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items()]
    text = '{\n "meta": ' + json.dumps(meta) + ',\n "cases": {\n'
    text += ",\n".join(lines) + "\n }\n}\n"
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(text)


def _differences(golden: dict[str, Any], now: dict[str, Any]) -> list[str]:
    diffs = []
    for key in golden.keys() - now.keys():
        diffs.append(f"{key}: in the golden table, not run")
    for key in now.keys() - golden.keys():
        diffs.append(f"{key}: run, not in the golden table")
    for key in [k for k in golden if k in now]:
        g, n = golden[key], now[key]
        if g == n:
            continue
        if "error" in g or "error" in n:
            diffs.append(f"{key}: golden {g} vs now {n}")
            continue
        what = []
        for field in ("step_bytes", "step_bytes_rank1"):
            if g[field] != n[field]:
                what.append(f"{field} golden {g[field]} vs now {n[field]}")
        if g["hash"] != n["hash"]:
            what.append(f"params hash golden {g['hash'][:12]} vs now {n['hash'][:12]}")
        diffs.append(f"{key}: " + "; ".join(what))
    return diffs


def test_golden_pipeline() -> None:
    out = run_processes(2, golden_workers.golden_runs, timeout=120)
    table, bad = _table(out)
    if os.environ.get("SPARCML_WRITE_GOLDEN") == "1":
        assert not bad, "not writing a golden table with failed cases:\n" + "\n".join(bad)
        _write(table)
        pytest.skip(f"SPARCML_WRITE_GOLDEN=1: wrote {len(table)} cases to {GOLDEN}")
    assert GOLDEN.exists(), f"{GOLDEN} missing: run with SPARCML_WRITE_GOLDEN=1"
    data = json.loads(GOLDEN.read_text())
    diffs = _differences(data["cases"], table)
    if diffs:
        version = data["meta"]["torch"]
        note = (
            f"\n(the table was written with torch {version}, this is {torch.__version__}: "
            "hashes may differ for that reason alone)"
            if version != torch.__version__
            else ""
        )
        pytest.fail(
            f"{len(diffs)} of {len(table)} cases differ from {GOLDEN.name}:\n"
            + "\n".join(sorted(diffs))
            + note
            + ("\nalso failed:\n" + "\n".join(bad) if bad else ""),
            pytrace=False,
        )
    assert not bad, "\n".join(bad)
