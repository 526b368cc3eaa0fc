"""The command line: the demo end to end on spawned ranks, and argument errors."""

from __future__ import annotations

import json

import pytest

from sparcml import algorithms
from sparcml.collectives.registry import algorithm_info
from sparcml.tools.cli import main


@pytest.mark.spawn
def test_demo_runs_every_algorithm_and_checks_results(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out_json = tmp_path / "r.json"
    rc = main(
        ["bench", "-P", "3", "-N", "50K", "-d", "0.02", "--repeats", "2", "--json", str(out_json)]
    )
    text = capsys.readouterr().out
    assert rc == 0
    # the two-level rows join only where the ranks span several nodes (one host here)
    flat = [a for a in algorithms(exact=True) if not algorithm_info(a).two_level]
    for name in [*flat, "auto"]:
        assert name[:20] in text
    assert "twolevel" not in text
    rows = [line for line in text.splitlines() if not line.startswith("(")]  # not the legend
    assert not any("WRONG" in line for line in rows)
    doc = json.loads(out_json.read_text())
    assert doc["config"]["world_size"] == 3 and doc["machine"]["versions"]["torch"]
    # every exact algorithm, auto, and the 16-bit dense baseline (fp16_compress_hook's)
    assert {r["algorithm"] for r in doc["rows"]} == {*flat, "auto", "dense_fp16"}
    assert all(r["correct"] for r in doc["rows"])
    dense = next(r for r in doc["rows"] if r["algorithm"] == "dense")
    assert dense["speedup_vs_dense"] == pytest.approx(1.0)
    half = next(r for r in doc["rows"] if r["algorithm"] == "dense_fp16")
    assert half["speedup_vs_fp16"] == pytest.approx(1.0) and 0 < half["max_rel_error"] < 2e-3
    # nccl-tests' bandwidths and the local CPU column
    assert dense["busbw_gbps"] == pytest.approx(dense["algbw_gbps"] * 4 / 3)
    assert dense["algbw_gbps"] == pytest.approx(dense["bytes_in"] / dense["p50"] / 1e9)
    assert all(r["cpu_p50"] > 0 for r in doc["rows"])
    # the sparse algorithms move far fewer bytes than the dense allreduce at 2% density
    rd = next(r for r in doc["rows"] if r["algorithm"] == "ssar_recursive_double")
    assert rd["bytes_sent"] < dense["bytes_sent"] / 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "-d", "1.5"], "must lie in [0, 1]"),
        (["demo", "-P", "0"], "must be at least 1"),
        (["demo", "-N", "lots"], "not a size"),
        (["demo", "-a", "fastest"], "unknown algorithms"),
    ],
)
def test_bad_arguments_give_clear_errors(capsys, argv, needle) -> None:  # type: ignore[no-untyped-def]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_algorithms_lists_the_registry(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(":")[1].strip().split(", ") == [*algorithms(exact=True), "auto"]
    assert lines[1].split(":")[1].strip().split(", ") == algorithms(exact=False)
    assert {"gtopk", "gaussiank", "oktopk"} == set(algorithms(exact=False))


@pytest.mark.spawn
def test_readme_torchrun_example_runs() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "torchrun_allreduce.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "identical on every rank: True" in done.stdout


@pytest.mark.spawn
@pytest.mark.parametrize("method", ["topk", "oktopk"])
def test_ddp_example_switches_a_script_in_three_lines(method: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "ddp_train.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
           "--method", method, "--steps", "20"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[:1500] + done.stderr[-1500:]
    assert "models identical on every rank: True" in done.stdout


@pytest.mark.spawn
def test_bench_peers_and_a_density_sweep_plot(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    files = []
    for d in ("0.001", "0.3"):
        f = tmp_path / f"d{d}.json"
        argv = ["bench", "-P", "2", "-N", "64K", "-d", d, "--repeats", "2", "--peers",
                "-a", "dense", "-a", "ssar_recursive_double", "-a", "dsar_split_allgather",
                "--json", str(f), "-q"]  # fmt: skip
        assert main(argv) == 0
        files.append(str(f))
    with open(files[0]) as fh:
        doc = json.load(fh)
    rows = {r["algorithm"]: r for r in doc["rows"]}
    # fp16 rounds within float16 precision; PowerSGD is lossy but the same on every rank
    assert (
        rows["torch_fp16_hook"]["correct"] and 0 < rows["torch_fp16_hook"]["max_rel_error"] < 2e-3
    )
    assert (
        rows["torch_powersgd_hook"]["correct"]
        and rows["torch_powersgd_hook"]["max_rel_error"] > 0.1
    )
    # ring volumes: fp16 is half of dense's float32 ring
    assert rows["torch_fp16_hook"]["bytes_sent"] == pytest.approx(2 * 65536, rel=1e-6)
    capsys.readouterr()
    png = tmp_path / "sweep.png"
    assert main(["bench-plot", *files, "--over", "density", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| density | dense |" in out and "fastest" in out and png.stat().st_size > 1000
    assert main(["bench-plot", files[0], "--over", "P"]) == 2


def test_bench_rows_print_their_compared_error_or_a_dash() -> None:
    """A row with an error prints it with ok/WRONG; a row that compared nothing
    prints "-" in both columns, never "0.0e+00 ok"."""
    from sparcml.tools.bench.allreduce import BenchConfig, check_label, format_table

    base = {"p25": 1e-3, "p50": 1e-3, "p75": 1e-3, "bytes_sent": 8.0, "result_nnz": 2,
            "result_dense": False, "speedup_vs_dense": None}  # fmt: skip
    rows = [
        {**base, "algorithm": "checked", "max_rel_error": 3e-8, "correct": True},
        {**base, "algorithm": "wrong", "max_rel_error": 0.5, "correct": False},
        {**base, "algorithm": "unchecked", "max_rel_error": None, "correct": None},
    ]
    assert [check_label(r) for r in rows] == ["ok", "WRONG", "-"]
    table = format_table(rows, BenchConfig(world_size=2, size=8))
    line = {ln.split()[0]: ln for ln in table.splitlines() if ln.split()}
    assert "3.0e-08" in line["checked"] and " ok " in line["checked"]
    assert "e+00" not in line["unchecked"] and " ok " not in line["unchecked"]
    assert line["unchecked"].split()[-6:-4] == ["-", "-"]  # max rel err, check


def test_a_typo_in_a_sub_command_option_shows_that_sub_command_s_usage(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--dnsity", "0.1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sparcml bench ") and "unrecognized arguments: --dnsity" in err


def test_bench_gpu_runs_its_three_tables_on_the_cpu(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import torch

    from sparcml.tools.cli import main

    out = tmp_path / "gpu.json"
    args = ["bench-gpu", "--device", "cpu", "--mb", "1", "--repeats", "1", "-q"]
    assert main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for table in ("selection", "quantizers", "stream kernels", "targets:"):
        assert table in printed
    rows = json.loads(out.read_text())["rows"]
    tables = {r["table"] for r in rows}
    assert tables == {"selection", "quantizers", "streams"}
    sel = [r for r in rows if r["table"] == "selection"]
    assert len(sel) == 2 * 7 and all(r["selected"] > 0 for r in sel)
    if not torch.cuda.is_available():
        assert main(["bench-gpu", "-q"]) == 2  # cuda asked for, none here
        assert "no CUDA device" in capsys.readouterr().err


def test_bench_local_counts_the_bytes_the_messages_take() -> None:
    """bench-local's bounds count the messages as sent (their smaller index fields)."""
    from sparcml.indexcode import index_field_nbytes
    from sparcml.tools.bench.local import _rank_bound_bytes, kernel_rows

    rows = {r["kernel"]: r for r in kernel_rows(1 << 16, 4, 0.02, 1)}
    assert all(r["bound_ms"] > 0 for r in rows.values())
    n, k = 1 << 20, 8192
    coded = _rank_bound_bytes("ssar_split_allgather", n, 4, k, 4 * k)
    wire_pair = index_field_nbytes(n, k) / k + 4
    assert coded == round(k * 12 + 2 * k * wire_pair + k * 12 + 4 * k * wire_pair + 4 * k * 12)


def test_phase_clocks_record_every_call_on_every_clock() -> None:
    """The phase benchmarks' helper: a wrapped function's calls are timed on the wall
    clock and in user and system CPU, medians per (clock, phase), one column per rank."""
    import time

    from sparcml.tools.bench.phases import CLOCKS, Phases, table

    phases = Phases()
    busy = phases.timed("1 busy", lambda n: sum(range(n)))
    sleepy = phases.timed("2 sleep", time.sleep)
    assert busy(200_000) == sum(range(200_000))
    for _ in range(3):
        sleepy(0.01)
    assert {k for k in phases.spent} == {(c, p) for c in CLOCKS for p in ("1 busy", "2 sleep")}
    ms = phases.medians_ms()
    assert ms[("wall", "2 sleep")] >= 10.0 and ms[("user", "2 sleep")] < 5.0
    assert len(phases.spent[("wall", "2 sleep")]) == 3
    lines = table([ms, None, ms])  # a rank that sent nothing is left out
    assert len(lines) == 6 and lines[0].split()[:3] == ["sys", "1", "busy"]
    assert all(len(line.split()) == 3 + 2 for line in lines)
    phases.clear()
    assert phases.spent == {}
