"""Calibration: the line fit, and a measurement over in-process ranks stored and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparcml.comm import run_ranks
from sparcml.costmodel import CostModel
from sparcml.tools.calibrate import fit_alpha_beta, fit_line, measure, to_model
from sparcml.tools.cli import main


def test_fit_line_recovers_alpha_and_beta() -> None:
    xs = [0.0, 1e3, 1e4, 1e5, 1e6]
    a, b = fit_line(xs, [5e-5 + 2e-9 * x for x in xs])
    assert a == pytest.approx(5e-5) and b == pytest.approx(2e-9)
    assert fit_line([1.0, 2.0], [3.0, 1.0]) == (
        pytest.approx(5.0),
        0.0,
    )  # clamped, no negative beta


def test_alpha_is_the_empty_message_and_beta_the_slope_of_the_rest() -> None:
    sizes = [0.0, 1e3, 1e5, 1e6, 4e6]
    times = [1e-4 + 8e-9 * s for s in sizes]
    times[2] = 1e-4  # a shaper's burst: a mid-size message as cheap as an empty one
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(1e-4)
    assert b == pytest.approx(8e-9, rel=0.01)


def test_measure_gives_the_same_positive_figures_on_every_rank(tmp_path: Path) -> None:
    # the figures are timings: on a loaded machine a fitted slope can come out 0
    # (clamped); identical on every rank every time, positive in one of 3 tries
    for _ in range(3):
        out = run_ranks(2, measure, 3, (0, 1 << 12, 1 << 16), (1 << 14, 1 << 16))
        assert out[0]["alpha"] == out[1]["alpha"] and out[0]["beta"] == out[1]["beta"]
        f = out[0]
        assert f["alpha"] >= 0 and f["beta_sparse"] >= 0 and f["gamma"] >= 0
        if f["beta_sparse"] > 0 and f["gamma"] > 0:
            break
    assert f["beta_sparse"] > 0 and f["gamma"] > 0, f
    model = to_model(f)
    path = model.save(tmp_path / "cal.json")
    loaded = CostModel.load(path)
    assert loaded.alpha == model.alpha and loaded.beta_sparse == model.beta_sparse
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_ranks(1, measure)


@pytest.mark.spawn
def test_cli_calibrate_writes_where_auto_reads(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "c.json"))
    assert main(["calibrate", "--repeats", "2", "--json", str(tmp_path / "all.json")]) == 0
    assert CostModel.load().source == str(tmp_path / "c.json")
    doc = json.loads((tmp_path / "all.json").read_text())
    assert len(doc["rows"]["ping_one_way_s"]) == 7 and doc["machine"]["versions"]["torch"]
