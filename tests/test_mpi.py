"""The MPI transport under ``mpirun -n 2, 3, 4`` (skipped without the ``mpi`` extra).

Every exact algorithm equals the dense float64 reference on integer data with
bitwise identical results across ranks; non-blocking calls; a size mismatch
fails on every rank; a late rank is named by the others' timeout; and the same
small training run gives the same parameters under mpirun as over gloo
(bitwise for the sparse methods, whose reduction order is ours; 1e-6 for dense,
whose order is MPI's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_workers
from sparcml.comm import mpi_available
from sparcml.comm.launch import run_processes

MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
pytestmark = [
    pytest.mark.spawn,
    pytest.mark.skipif(
        not mpi_available() or MPIRUN is None,
        reason="needs the mpi extra: pip install 'sparcml[mpi]'",
    ),
]
WORKER = Path(__file__).parent / "mpi_workers.py"


def mpirun(n: int, tmp: Path, *extra: str) -> list[dict]:
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    cmd = [MPIRUN, "-n", str(n), "--oversubscribe", sys.executable, str(WORKER), str(tmp), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [3, 4])  # P = 2 runs in the example and bench-mpi tests
def test_mpirun_collectives_and_training_match_gloo(n: int, tmp_path: Path) -> None:
    out = mpirun(n, tmp_path)
    for r, o in enumerate(out):
        c = o["collectives"]
        assert c["bad"] == []
        assert all(
            torch.equal(a, b)
            for a, b in zip(c["results"], out[0]["collectives"]["results"], strict=True)
        )
        assert "different sizes across ranks" in c["mismatch"] and "rank 1: N=49" in c["mismatch"]
        assert torch.equal(c["dense"], torch.arange(6.0) * sum(range(1, n + 1)))
        assert [t.tolist() for t in c["gathered"]] == [[q, 7] for q in range(n)]
        assert c["bytes_sent"] > 0
        for method, params in o["training"].items():
            assert torch.equal(params, out[0]["training"][method]), (r, method)
    for method in ["topk", "dense", "oktopk"]:
        hyper = {
            "topk": {"density": 0.05, "algorithm": "ssar_split_allgather"},
            "dense": {},
            "oktopk": {"density": 0.05},
        }[method]
        gloo = run_processes(n, train_workers.sync_train, method, hyper, 5, timeout=60)
        mpi = out[0]["training"][method]
        if method == "dense":
            assert torch.allclose(gloo[0], mpi, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(gloo[0], mpi), method


@pytest.mark.timeout(120)
def test_mpi_example_runs_under_mpirun() -> None:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    script = Path(__file__).parent.parent / "examples" / "mpi_train.py"
    cmd = [MPIRUN, "-n", "2", "--oversubscribe", sys.executable, str(script), "--steps", "10"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "models identical on every rank: True" in done.stdout


@pytest.mark.timeout(120)
def test_mpirun_late_rank_is_named_by_the_others(tmp_path: Path) -> None:
    out = mpirun(3, tmp_path, "timeout-check")
    for r in (0, 2):
        msg = out[r]["timeout"]
        assert msg.startswith("peer=1:") and "rank 1" in msg and "timed out" in msg
        # a large dense allreduce (MPI's blocking collective on a helper thread)
        dense = out[r]["dense"]
        assert dense.startswith("CommTimeoutError: rank") and "timed out" in dense, dense
        assert "then CommError" in dense and "still inside MPI" in dense, dense
    assert out[1]["dense"] == "late: 3.0"


@pytest.mark.timeout(120)
def test_bench_mpi_prints_the_ratio_under_mpirun(tmp_path: Path) -> None:
    """``sparcml bench-mpi``: both ways give a time, the ratio is printed and the JSON
    holds one row per size (a 4 MB size takes the blocking-collective path)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    out = tmp_path / "mpi.json"
    cmd = [MPIRUN, "-n", "2", "--oversubscribe", sys.executable, "-m", "sparcml.tools.cli",
           "bench-mpi", "-N", "1K", "1M", "--repeats", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sparcml/mpi4py" in done.stdout
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["N"] for r in rows] == [1024, 1 << 20]
    assert all(r["sparcml_ms"] > 0 and r["mpi4py_ms"] > 0 and r["ratio"] > 0 for r in rows)
