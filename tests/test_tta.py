"""Time-to-accuracy harness: the report on synthetic runs, PyTorch's peer hooks on a
2-rank gloo group, and the command line's checks (no cluster is started here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tta_workers
from sparcml.comm.launch import run_processes
from sparcml.tools.cli import main
from sparcml.tools.recipes.tta import (
    format_predictions,
    format_seeds_table,
    format_tta_table,
    parse_rate,
    predict_rows,
    targets,
    time_to,
    tta_rows,
    write_seeds_report,
    write_tta_report,
)
from sparcml.torch.peers import is_peer, peer_rank


def _run(curve: list[float], seconds: list[float], step_bytes: float, steps: int = 40,
         metric: str = "accuracy", **extra: Any) -> dict[str, Any]:  # fmt: skip
    per = steps // (len(curve) - 1)
    evals = [
        {metric: v, "test_loss": 1.0, "step": i * per, "train_s": s}
        for i, (v, s) in enumerate(zip(curve, seconds, strict=True))
    ]
    return {
        "losses": [1.0] * steps,
        "step_bytes": [step_bytes] * steps,
        "step_times": [seconds[-1] / steps] * steps,
        "opt_times": [0.001] * steps,
        "compute_s": 0.5 * seconds[-1] / steps,
        "train_s": seconds[-1],
        "evals": evals,
        **extra,
    }


def _result(runs: dict[str, Any], metric: str = "accuracy", higher: bool = True) -> dict[str, Any]:
    return {"recipe": "x", "world": 4, "epochs": 1, "seed": 0, "metric": metric,
            "higher_is_better": higher, "options": {}, "link_rate": "100mbit",
            "runs": runs}  # fmt: skip


def test_time_to_accuracy_and_speedups_on_synthetic_runs(tmp_path: Path) -> None:
    result = _result({
        "ddp": _run([0.1, 0.6, 0.80, 0.85], [0, 10, 20, 30], 1000.0),
        "fp16": _run([0.1, 0.6, 0.84, 0.85], [0, 6, 12, 18], 500.0),
        "powersgd": _run([0.1, 0.5, 0.70, 0.83], [0, 5, 10, 15], 50.0,
                         hyper={"start_iter": 4}),
        "topk": _run([0.1, 0.7, 0.845, 0.86], [0, 2, 4, 6], 20.0,
                     hyper={"warmup_steps": 4}),
        "natural": _run([0.1, 0.2, 0.3, 0.4], [0, 1, 2, 3], 300.0),
    })  # fmt: skip
    assert targets(result) == pytest.approx((0.85, 0.84))
    rows = {r["method"]: r for r in tta_rows(result, parse_rate("100mbit"))}
    assert rows["ddp"]["to_within_s"] == 30 and rows["ddp"]["to_final_s"] == 30
    assert rows["fp16"]["to_within_s"] == 12 and rows["fp16"]["to_final_s"] == 18
    assert rows["powersgd"]["to_within_s"] is None  # 0.83 never within 1 point of 0.85
    assert rows["topk"]["to_within_s"] == 4 and rows["topk"]["to_final_s"] == 6
    assert rows["topk"]["speedup_vs_dense"] == pytest.approx(7.5)
    assert rows["topk"]["speedup_vs_best_hook"] == pytest.approx(3.0)
    assert rows["topk"]["best_hook"] == "fp16"
    assert rows["natural"]["speedup_vs_dense"] is None
    # bytes to the target: 2 evaluations of 13 steps each
    assert rows["topk"]["bytes_to_within"] == 26 * 20.0
    # the step split: compute half the step, optimizer 1 ms, the rest synchronisation
    assert rows["ddp"]["ms_per_step"] == pytest.approx(750.0)
    assert rows["ddp"]["sync_ms"] == pytest.approx(750.0 - 375.0 - 1.0)
    # 1000 bytes of payload, 1514 bytes on the link per 1448 (headers), at 100 Mbit/s
    assert rows["ddp"]["wire_ms"] == pytest.approx(1000 * 1514 / 1448 * 8 / 1e8 * 1000)
    assert rows["topk"]["warmup_steps"] == 4
    table = format_tta_table(result, 1e8)
    assert "| topk | 86.00% | 4.0 | 26 | 6.0 | 0.0 | 7.50x | 3.00x | 6.0 |" in table
    assert "| powersgd | 83.00% | never | never | never | - | - | - | 15.0 |" in table
    paths = write_tta_report(result, tmp_path, "sparcml train x --cluster 4", 1e8)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["command"] == "sparcml train x --cluster 4" and doc["link_rate_bps"] == 1e8
    assert {"machine", "summary", "rows"} <= doc.keys() and "torch" in json.dumps(doc["machine"])
    assert "fp16" in (tmp_path / "summary.csv").read_text()
    assert (tmp_path / "tta.png") in paths and (tmp_path / "tta.png").stat().st_size > 1000
    # the report again from its JSON, the same tables
    again = tmp_path / "again"
    assert main(["train", "fmnist", "--from-json", str(tmp_path / "results.json"),
                 "--out", str(again)]) == 0  # fmt: skip
    assert (again / "results.md").read_text() == (tmp_path / "results.md").read_text()
    # how the emulated links were shaped heads the report (results before it have none)
    assert "Links:" not in (tmp_path / "results.md").read_text()
    write_tta_report({**result, "link": "bucket 15625b, offloads off"}, tmp_path, "c", 1e8)
    assert "Links: bucket 15625b, offloads off" in (tmp_path / "results.md").read_text()


def test_sync_beyond_the_link_and_the_prediction_for_other_links() -> None:
    # compute 375 ms, optimizer 1 ms, sync 374 ms of a 750 ms step; 1000 bytes at 100 Mbit/s
    # is 0.084 ms on the wire (headers counted), 4 messages 0.2 ms: the rest is local work
    w = 1514 / 1448 * 8e-5 * 1000  # ms per 1000 bytes at 100 Mbit/s
    ddp = _run([0.1, 0.6, 0.80, 0.85], [0, 10, 20, 30], 1000.0, messages_per_step=4.0)
    topk = _run([0.1, 0.7, 0.845, 0.86], [0, 2, 4, 6], 1e6, hyper={"warmup_steps": 4})
    result = _result({"ddp": ddp, "topk": topk})
    rows = {r["method"]: r for r in tta_rows(result, 1e8)}
    assert rows["ddp"]["overhead_ms"] == pytest.approx(374.0 - w - 0.2)
    # topk: 150 ms steps, 75 compute, 1 optimizer, 74 sync of which 80 ms would be wire:
    # the measured sync is below the link time (the figure says so: negative)
    assert rows["topk"]["overhead_ms"] == pytest.approx(74.0 - 1000 * w)
    preds = {p["method"]: p for p in predict_rows(result, 1e8, ["10mbit", "100mbit", "1gbit"])}
    # the measured rate gives the measured step back (ddp: overhead >= 0)
    assert preds["ddp"]["ms_per_step@100mbit"] == pytest.approx(750.0)
    # 10x slower link: the wire term 10x, the rest unchanged
    assert preds["ddp"]["ms_per_step@10mbit"] == pytest.approx(750.0 + 9 * w)
    # a negative overhead is clamped: topk at 1 Gbit/s = compute + optimizer + wire
    assert preds["topk"]["ms_per_step@1gbit"] == pytest.approx(75.0 + 1.0 + 100 * w)
    # time to within: 26 steps, the first 4 (dense warm-up) at ddp's predicted step
    t = (4 * preds["ddp"]["ms_per_step@1gbit"] + 22 * (76.0 + 100 * w)) / 1000
    assert preds["topk"]["s_to_within@1gbit"] == pytest.approx(t)
    table = format_predictions(result, 1e8, ["10mbit", "1gbit"])
    assert "| topk | 26 |" in table and "Use (least predicted time" in table
    assert "10mbit: topk" in table


def test_seeds_table_gives_medians_and_ranges(tmp_path: Path) -> None:
    def seed(s: int, t_topk: float, reach: bool = True) -> dict[str, Any]:
        curve = [0.1, 0.7, 0.845, 0.86] if reach else [0.1, 0.2, 0.3, 0.4]
        r = _result({
            "ddp": _run([0.1, 0.6, 0.80, 0.85], [0, 10, 20, 30], 1000.0, loadavg=[0.5, 1, 1]),
            "topk": _run(curve, [0, t_topk / 2, t_topk, 2 * t_topk], 20.0),
        })  # fmt: skip
        r["seed"] = s
        return r

    results = [seed(0, 4.0), seed(1, 6.0), seed(2, 3.0, reach=False)]
    table = format_seeds_table(results, 1e8)
    # topk reached within 1 point in 4 s and 6 s (median 5.0), never with seed 2
    assert "| topk | 86.00% (40.00%-86.00%) | 5.0 (4.0-6.0), never in 1 |" in table
    # 30 / 4 and 30 / 6 seconds against dense; no PyTorch hook in these runs
    assert "| 6.25x (5.00x-7.50x), - in 1 | - |" in table
    # a method whose job failed in a seed is marked, not silently averaged over fewer
    failed = seed(3, 5.0)
    del failed["runs"]["topk"]
    table = format_seeds_table([*results, failed], 1e8)
    assert "| topk (not in seed 3: its run failed) | 86.00% (40.00%-86.00%) |" in table
    assert "| ddp |" in table  # (ran in every seed)
    paths = write_seeds_report(results, tmp_path, "sparcml train x --seeds 0,1,2", 1e8)
    doc = json.loads((tmp_path / "seeds.json").read_text())
    assert doc["seeds"] == [0, 1, 2] and paths[1].read_text().count("seed") >= 4
    assert "Highest 1-minute load average" in (tmp_path / "results.md").read_text()
    linked = [{**r, "link": "bucket 15625b, offloads off"} for r in results]
    write_seeds_report(linked, tmp_path, "c", 1e8)
    assert "Links: bucket 15625b" in (tmp_path / "results.md").read_text()
    assert (
        json.loads((tmp_path / "seeds.json").read_text())["link"] == "bucket 15625b, offloads off"
    )


def test_perplexity_targets_are_within_three_percent() -> None:
    result = _result(
        {"ddp": _run([20.0, 8.0, 6.0], [0, 5, 10], 1.0, metric="perplexity"),
         "topk": _run([20.0, 6.1, 6.5], [0, 2, 4], 1.0, metric="perplexity")},
        metric="perplexity", higher=False,
    )  # fmt: skip
    assert targets(result) == pytest.approx((6.0, 6.18))
    assert time_to(result["runs"]["topk"], "perplexity", 6.18, False) == 2
    rows = {r["method"]: r for r in tta_rows(result)}
    assert rows["topk"]["best"] == 6.1 and rows["topk"]["speedup_vs_dense"] == pytest.approx(5.0)
    assert rows["topk"]["wire_ms"] is None  # no link rate: loopback


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 1e8 and parse_rate("1gbit") == 1e9
    assert parse_rate("2.5Gbit") == 2.5e9
    for bad in ("100mbps", "fast", "0mbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="not a link rate"):
            parse_rate(bad)


def test_peer_names() -> None:
    assert all(is_peer(m) for m in ("ddp", "fp16", "bf16", "powersgd", "powersgd4"))
    assert not any(is_peer(m) for m in ("dense", "topk", "powersgd0", "powersgdx"))
    assert peer_rank("powersgd") == 2 and peer_rank("powersgd1") == 1


def test_compute_is_the_slowest_ranks_time_of_each_probe_step() -> None:
    from sparcml.tools.recipes.train import compute_split

    # step 0: rank 1 the slower (0.2 s), step 1: rank 0 (0.3 s), step 2: both 0.1 s;
    # a synchronous step waits for the slower rank, whichever it is
    rank0 = torch.tensor([0.1, 0.3, 0.1], dtype=torch.float64)
    rank1 = torch.tensor([0.2, 0.1, 0.1], dtype=torch.float64)
    split = compute_split([rank0, rank1])
    assert split["compute_s"] == pytest.approx((0.2 + 0.3 + 0.1) / 3)
    # the earlier figure: each rank's median (0.1 s both), which missed both waits
    assert split["compute_rank_median_s"] == pytest.approx(0.1)
    assert compute_split([rank0])["compute_s"] == pytest.approx(0.5 / 3)  # one rank: its mean
    # an even number of passes: the upper of the two middle ones, as the harness took it
    even = compute_split([torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)])
    assert even["compute_rank_median_s"] == pytest.approx(0.3)


def test_pytorch_peer_hooks_train_on_two_gloo_ranks() -> None:
    methods = ["ddp", "fp16", "bf16", "powersgd"]
    both = run_processes(2, tta_workers.peer_steps, methods, 4, 2, timeout=60)
    for method in methods:
        _check_peer(method, [both[0][method], both[1][method]])


def test_plain_ddp_counts_a_sparse_gradient_as_gloo_gathers_it() -> None:
    """Plain DDP sums a sparse gradient with gloo's sparse allreduce (an allgather of
    indices and values): (P - 1) / P of the summed rows, 8 bytes of index and 4 of
    value each, not the ring of the dense weight (``sparse=1`` runs)."""
    out = run_processes(2, tta_workers.sparse_ddp_bytes, timeout=60)
    rows = out[0]["rows"]
    assert rows == 11  # 5 + 5 rows of the ranks' own, row 50 shared
    assert out[0]["bytes"] == [round(2 * 0.5 * 4 + 0.5 * rows * 12)]  # the bias by the ring


def _check_peer(method: str, out: list[dict[str, Any]]) -> None:
    params = 32 * 32 + 32 + 32 * 4 + 4
    dense = 2 * (2 - 1) / 2 * 4 * params
    for r in out:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert len(r["bytes"]) == 4
    assert torch.equal(out[0]["params"], out[1]["params"])  # the ranks stay in step
    b = out[0]["bytes"]
    if method == "ddp":
        assert b == [round(dense)] * 4
    elif method in ("fp16", "bf16"):
        assert b == [round(dense / 2)] * 4
    else:
        # two dense steps (start_powerSGD_iter = 2), then the factors: 32x32 at rank 2
        # (P 32x2, Q 32x2) compressed; 32x4 is not worth it, sent whole with the biases
        assert b[:2] == [round(dense)] * 2
        assert b[2:] == [(4 * (2 * 64 + 32 + 128 + 4))] * 2
        assert out[0]["hyper"]["matrix_approximation_rank"] == 2


def test_cli_refuses_dense_only_methods_with_sparse_gradients(capsys) -> None:  # type: ignore[no-untyped-def]
    """newsgroups with sparse=1: methods that take dense gradients only (PyTorch's
    compression hooks, sparcml's quantizers) are refused before any rank starts."""
    for methods, named in [("ddp,bf16", "bf16"), ("nonzeros,natural", "natural")]:
        argv = ["train", "newsgroups", "--methods", methods, "--recipe-option", "sparse=1"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"sparse=1: {named} take dense gradients only" in err, err
    assert main(["train", "newsgroups", "--recipe-option", "sparse=2"]) == 2
    assert "sparse takes 0 or 1, got 2" in capsys.readouterr().err


def test_cli_checks_cluster_arguments(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["train", "fmnist", "--cluster", "4", "--rate", "100mbps"]) == 2
    assert "not a link rate" in capsys.readouterr().err
    assert main(["train", "fmnist", "--cluster", "4", "--env"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["train", "fmnist", "--methods", "fp16", "--fsdp"]) == 2
    assert "DDP-only" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["train", "fmnist", "--cluster", "4", "--rate", "1gbit"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_runs_stopped_at_a_given_target_are_timed_to_that_target() -> None:
    # --target 0.80 --stop-after 1: dense stopped at 0.85 (past the target by more than
    # a point); topk stopped at 0.81. Both reached the target they stopped at.
    result = _result({
        "ddp": _run([0.1, 0.6, 0.85], [0, 10, 20], 1000.0),
        "topk": _run([0.1, 0.7, 0.81], [0, 2, 4], 20.0),
    })  # fmt: skip
    result["options"] = {"target": 0.80, "stop_after": 1}
    assert targets(result) == pytest.approx((0.85, 0.80))
    rows = {r["method"]: r for r in tta_rows(result)}
    assert rows["topk"]["to_within_s"] == pytest.approx(4.0)  # (was "never": 0.84 asked)


def test_seeds_rotate_the_methods_after_the_baseline(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each method runs as its own job; with ``rotate`` the methods after the
    baseline run in a rotated order (the baseline first, its final figure the
    target), and the result lists them in the order given, with ``run_order``."""
    import sparcml.tools.cluster as cluster
    from sparcml.tools.recipes import RECIPES
    from sparcml.tools.recipes.tta import rotated, run_on_cluster

    ran: list[str] = []

    def job(hosts, argv, **kw):  # type: ignore[no-untyped-def]
        method = argv[argv.index("--methods") + 1]
        ran.append(method)
        run = {"evals": [{"step": 1, "accuracy": 0.5, "train_s": 1.0}], "step_bytes": [1]}
        doc = {"recipe": "fmnist", "runs": {method: run}}
        Path(argv[argv.index("--run-json") + 1]).write_text(json.dumps(doc))
        return 0

    monkeypatch.setattr(cluster, "run_on_cluster", job)
    monkeypatch.setattr(RECIPES["fmnist"], "check_data", classmethod(lambda cls: None))
    methods = ["topk", "ddp", "nonzeros", "fp16"]
    expected = [
        ["ddp", "topk", "nonzeros", "fp16"],  # seed 0
        ["ddp", "nonzeros", "fp16", "topk"],  # seed 1: each method last once
        ["ddp", "fp16", "topk", "nonzeros"],
    ]
    for place, order in enumerate(expected):
        ran.clear()
        out = run_on_cluster("fmnist", methods, 2, "1gbit", [], stop_after=2, rotate=place)
        assert ran == order and out["run_order"] == order
        assert list(out["runs"]) == ["ddp", "topk", "nonzeros", "fp16"]
    assert rotated(["a", "b"], 3) == ["b", "a"] and rotated(["x"], 2, keep_first=True) == ["x"]


def test_the_hosts_steal_is_read_and_flagged(tmp_path: Path) -> None:
    """Runs on a virtual machine whose host took CPU time (steal, which the load average
    does not show) are reported with it, and flagged past STEAL_FLAG, per run and per
    seed; /proc/stat's cpu line is read as user..steal."""
    from sparcml.tools.bench.harness import STEAL_FLAG, cpu_times, steal_share

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    assert cpu_times(str(stat)) == (35, 1000)
    assert cpu_times(str(tmp_path / "none")) is None
    stat.write_text("intr 1 2 3\n")
    assert cpu_times(str(stat)) is None
    assert steal_share((35, 1000), (45, 2000)) == pytest.approx(0.01)
    assert steal_share(None, (45, 2000)) is None and steal_share((35, 1000), (35, 1000)) is None
    quiet, busy = 0.002, 2.3 * STEAL_FLAG
    result = _result({
        "ddp": _run([0.1, 0.6, 0.80, 0.85], [0, 10, 20, 30], 1000.0, cpu_steal=quiet),
        "topk": _run([0.1, 0.7, 0.845, 0.86], [0, 2, 4, 6], 20.0, cpu_steal=busy),
    })  # fmt: skip
    write_tta_report(result, tmp_path, "c", 1e8)
    md = (tmp_path / "results.md").read_text()
    assert "CPU steal during each run" in md and "ddp 0.2%; topk 2.3%" in md
    assert "**Contended host** (topk: more than 1% steal)" in md
    result["runs"]["topk"]["cpu_steal"] = quiet
    write_tta_report(result, tmp_path, "c", 1e8)
    assert "Contended host" not in (tmp_path / "results.md").read_text()
    seeds = [{**result, "seed": s} for s in (0, 1)]
    seeds[1] = {**seeds[1], "runs": {**result["runs"], "topk": {**result["runs"]["topk"],
                                                               "cpu_steal": busy}}}  # fmt: skip
    write_seeds_report(seeds, tmp_path, "c", 1e8)
    md = (tmp_path / "results.md").read_text()
    assert "Highest CPU steal of a run, per seed" in md and "seed 0 0.2%; seed 1 2.3%" in md
    assert "**Contended host** (seed 1:" in md
    for run in result["runs"].values():  # no reading (not Linux): no line
        del run["cpu_steal"]
    write_tta_report(result, tmp_path, "c", 1e8)
    assert "CPU steal" not in (tmp_path / "results.md").read_text()
