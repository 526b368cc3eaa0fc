"""Calibration: the line fit, and a measurement over in-process ranks stored and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparcml.comm import run_ranks
from sparcml.costmodel import CostModel
from sparcml.tools.calibrate import fit, fit_alpha_beta, fit_line, fit_slope, measure, to_model
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


def test_a_burst_saved_at_every_large_size_stays_out_of_the_slope() -> None:
    """A shaper's burst saves the same time at every message larger than it: the
    slope over the large sizes is the link's time per byte; a line through the
    empty message's time would count the saving as a faster link (measured: 7.9
    ns/B on a 1 Gbit/s link, whose wire takes 8.37)."""
    beta, burst = 8.37e-9, 256 * 1024 * 8.37e-9
    sizes = [0.0, 1024.0, 65536.0, 262144.0, float(1 << 20), float(1 << 22)]
    times = [5e-4 + (s * beta if s <= 262144 else s * beta - burst + 1e-5) for s in sizes]
    times[3] = 5e-4 + 1e-5  # inside the burst: as cheap as an empty message
    alpha, slope = fit_alpha_beta(sizes, times)
    assert alpha == 5e-4 and slope == pytest.approx(beta, rel=1e-9)
    through_origin = sum(s * (t - alpha) for s, t in zip(sizes, times, strict=True)) / sum(
        s * s for s in sizes
    )
    assert through_origin < 0.95 * beta  # what the earlier fit gave
    # one large size only: through the empty message's time
    assert fit_slope([0.0, 10.0, 1000.0], [1.0, 1.0, 3.0], 1.0) == pytest.approx(2 / 1000, rel=0.01)


def test_dense_beta_is_the_ring_slope_with_its_latencies_in_the_intercept() -> None:
    """Step 2: a ring allreduce of ``n`` floats on ``P`` ranks moving ``2(P-1)/P n 4``
    bytes at ``beta``, its ``2(P-1)`` latencies overlapping the transfers (a
    constant), ``(P-1)/P n`` additions at ``gamma_dense``: ``fit`` gives ``beta``
    back, where subtracting ``2(P-1) alpha`` from each time did not."""
    p, beta, gd, alpha = 8, 8.4e-9, 5e-10, 6e-4
    sizes = [1 << 18, 1 << 20, 1 << 22]
    dense = [3e-3 + 2 * (p - 1) / p * n * 4 * beta + (p - 1) / p * n * gd for n in sizes]
    raw = {
        "world_size": p,
        "ping_sizes": [0, 1 << 20, 1 << 22],
        "ping_one_way_s": [alpha, alpha + (1 << 20) * 9e-9, alpha + (1 << 22) * 9e-9],
        "dense_sizes": sizes,
        "dense_allreduce_s": dense,
        "gamma": 2e-8,
        "gamma_dense": gd,
    }
    f = fit(raw)
    assert f["beta"] == pytest.approx(beta, rel=1e-9)
    assert f["beta_sparse"] == pytest.approx(9e-9, rel=1e-9)
    assert (f["alpha_intra"], f["beta_intra"]) == (f["alpha"], f["beta_sparse"])  # one link
    assert fit(f) == f  # fitting a fit's figures again changes nothing
    with pytest.raises(ValueError, match="not the measurements"):
        fit({"ping_sizes": [0]})
    with pytest.raises(ValueError, match="differ in number"):
        fit({**raw, "dense_allreduce_s": dense[:2]})


def test_cli_refit_fits_stored_measurements_again(tmp_path: Path) -> None:
    """``sparcml calibrate --refit FIGURES``: no ranks, the stored measurements of an
    earlier ``--json`` fitted by this version, written where ``--out`` says."""
    raw = {
        "world_size": 2,
        "ping_sizes": [0, 1 << 20, 1 << 22],
        "ping_one_way_s": [1e-4, 1e-4 + (1 << 20) * 8e-9, 1e-4 + (1 << 22) * 8e-9],
        "dense_sizes": [1 << 20, 1 << 22],
        "dense_allreduce_s": [1e-3 + n * 4 * 8.5e-9 for n in (1 << 20, 1 << 22)],
        "gamma": 2e-8,
        "gamma_dense": 0.0,
        "beta": 1e-12,  # what the old fit wrote: replaced
    }
    (tmp_path / "old.json").write_text(json.dumps({"kind": "calibrate", "rows": raw}))
    out = tmp_path / "new.json"
    assert main(["calibrate", "--refit", str(tmp_path / "old.json"), "--out", str(out)]) == 0
    model = CostModel.load(out)
    assert model.beta == pytest.approx(8.5e-9, rel=1e-9) and model.alpha == 1e-4
    assert model.beta_sparse == pytest.approx(8e-9, rel=1e-9)
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["calibrate", "--refit", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert main(["calibrate", "--refit", str(tmp_path / "none.json"), "--out", str(out)]) == 2


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
