"""Golden regression table of the training pipeline (before/after refactors).

Every method through every entry point (the DDP hook, ``sync_gradients``, FSDP2's
reduce-scatter, ``topk_sgd_step`` / ``oktopk_sgd_step``), 6 steps of plain SGD under
fixed seeds on one spawned gloo pair (:mod:`golden_workers`): each case's bytes per
step on both ranks and the SHA-256 of the final parameters must equal
``tests/data/golden_pipeline.json`` bit for bit.

Regenerate the table (only when a change of bytes or bits is intended)::

    SPARCML_WRITE_GOLDEN=1 pytest tests/test_golden_pipeline.py

The hashes pin floating-point rounding, and rounding depends on the kernels: another
torch version, or a CPU whose best kernels are others (``AVX512`` against ``AVX2``,
``torch.backends.cpu.get_cpu_capability()``: other summation orders in the matrix
products), changes every hash without any change in sparcml. The table records both;
where either differs from this machine's, each case's bytes must still be equal bit
for bit, and its parameters' fingerprint (norm and three fixed random projections,
:func:`golden_workers._digest`) equal within ``FINGERPRINT_RTOL`` of the norm: what
rounding moves, and a changed algorithm, selection or update does not stay within.
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
# measured: ATen's default kernels (ATEN_CPU_CAPABILITY=default) against AVX2 on one
# machine changed all 111 hashes, no byte count, and the fingerprints by at most
# 1.44e-06 of the norm; a margin of about 70x
FINGERPRINT_RTOL = 1e-4


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
            "fingerprint": r0["fingerprint"],
        }
    return table, bad


def _write(table: dict[str, Any]) -> None:
    meta = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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


def _kernels() -> str:
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} kernels"


def _same_fingerprint(g: list[float], n: list[float]) -> bool:
    scale = FINGERPRINT_RTOL * max(abs(g[0]), 1e-30)
    return len(g) == len(n) and all(abs(a - b) <= scale for a, b in zip(g, n, strict=True))


def _differences(golden: dict[str, Any], now: dict[str, Any], exact: bool) -> list[str]:
    """The cases that differ: bytes always bit for bit; parameters by their hash when
    ``exact`` (the table's kernels), else by their fingerprint."""
    diffs = []
    for key in golden.keys() - now.keys():
        diffs.append(f"{key}: in the golden table, not run")
    for key in now.keys() - golden.keys():
        diffs.append(f"{key}: run, not in the golden table")
    for key in [k for k in golden if k in now]:
        g, n = golden[key], now[key]
        if "error" not in g and "error" not in n and not exact:
            g, n = {**g, "hash": ""}, {**n, "hash": ""}
            if _same_fingerprint(g["fingerprint"], n["fingerprint"]):
                g["fingerprint"] = n["fingerprint"]
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
        elif g["fingerprint"] != n["fingerprint"]:
            worst = max(abs(a - b) for a, b in zip(g["fingerprint"], n["fingerprint"], strict=True))
            what.append(
                f"params fingerprint golden {g['fingerprint']} vs now {n['fingerprint']} "
                f"(off by {worst / abs(g['fingerprint'][0]):.2e} of the norm, allowed "
                f"{FINGERPRINT_RTOL:g})"
            )
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
    meta = data["meta"]
    written = f"torch {meta['torch']}, {meta.get('cpu_capability')} kernels"
    diffs = _differences(data["cases"], table, exact=written == _kernels())
    if diffs:
        note = (
            f"\n(the table was written with {written}, this is {_kernels()}: parameters "
            "compared by fingerprint)"
            if written != _kernels()
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
