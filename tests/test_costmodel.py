"""The alpha-beta cost model and algorithm="auto"."""

from __future__ import annotations

import json
import math

import pytest

from sparcml import CostModel
from sparcml.collectives.autotune import choose
from sparcml.collectives.registry import predict
from sparcml.costmodel import expected_fill_in


@pytest.mark.parametrize(("n", "k", "p"), [(512, 16, 4), (512, 64, 8), (10_000, 100, 16)])
def test_fill_in_matches_appendix_b_closed_form(n: int, k: int, p: int) -> None:
    inclusion_exclusion = n * sum(
        (-1) ** (i - 1) * math.comb(p, i) * (k / n) ** i for i in range(1, p + 1)
    )
    assert expected_fill_in(n, [k] * p) == pytest.approx(inclusion_exclusion, rel=1e-9)
    assert k <= expected_fill_in(n, [k] * p) <= min(n, p * k)


def test_fill_in_edge_cases() -> None:
    assert expected_fill_in(100, [100, 3]) == 100
    assert expected_fill_in(100, [0, 0]) == 0
    assert expected_fill_in(0, [1]) == 0


def test_auto_follows_the_papers_ordering() -> None:
    m = CostModel(alpha=50e-6, beta=8e-9, gamma=1e-9)  # 1 Gbit/s
    n = 16 * 2**20
    # tiny nnz: latency dominates -> recursive doubling
    assert choose(m, 8, n, [100] * 8, 4) == "ssar_recursive_double"
    # result far past delta -> DSAR beats both SSAR variants
    assert choose(m, 8, n, [n // 4] * 8, 4) == "dsar_split_allgather"
    # every input dense -> the dense allreduce is cheapest
    assert choose(m, 8, n, [n] * 8, 4) in {"dense", "dsar_split_allgather"}
    # as nnz grows, recursive doubling re-sends the densifying partial sums in every
    # stage while split allgather sends each range once (sec. 8.1)
    t_rd = predict(m, "ssar_recursive_double", 16, n, [n // 10] * 16, 4)
    t_sa = predict(m, "ssar_split_allgather", 16, n, [n // 10] * 16, 4)
    assert t_sa < t_rd


def test_predict_rejects_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'magic'"):
        predict(CostModel(), "magic", 4, 100, [1] * 4, 4)


def test_save_and_load(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "cal.json"
    CostModel(alpha=1e-5, beta=2e-9, gamma=3e-10, beta_sparse=4e-9).save(path)
    m = CostModel.load(path)
    assert (m.alpha, m.beta, m.gamma, m.beta_sparse) == (1e-5, 2e-9, 3e-10, 4e-9)
    assert m.source == str(path)
    monkeypatch.setenv("SPARCML_CALIBRATION", str(path))
    assert CostModel.load().alpha == 1e-5
    monkeypatch.setenv("SPARCML_CALIBRATION", str(tmp_path / "missing.json"))
    assert CostModel.load().source == "default"
    path.write_text(json.dumps({"alpha": "x"}))
    with pytest.raises(ValueError, match="invalid calibration"):
        CostModel.load(path)


def test_a_calibration_rewritten_at_once_is_read_again(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``auto`` loads the calibration on every call, parsed once per content: a file
    rewritten with the same size within the file system's timestamp resolution
    (a test, a script calibrating twice) must not give the old numbers."""
    path = tmp_path / "cal.json"
    monkeypatch.setenv("SPARCML_CALIBRATION", str(path))
    CostModel(alpha=1e-5, beta=2e-9).save(path)
    first = CostModel.load()
    assert CostModel.load() is first  # unchanged: not parsed again
    size = path.stat().st_size
    CostModel(alpha=3e-5, beta=2e-9).save(path)  # the same length, at once
    assert path.stat().st_size == size
    assert CostModel.load().alpha == 3e-5
    path.unlink()
    assert CostModel.load().source == "default"
    path.mkdir()
    with pytest.raises(ValueError, match="invalid calibration"):
        CostModel.load()


def test_auto_choice_follows_a_cost_formula_registered_again() -> None:
    """``choose`` keeps its predictions per model and registered facts: the same name
    registered again with another cost formula is costed again."""
    import dataclasses

    from sparcml.collectives import registry

    model = CostModel()
    names = ["ssar_recursive_double", "ssar_split_allgather"]
    before = choose(model, 8, 1 << 20, [8000] * 8, 4, names)
    other = next(n for n in names if n != before)
    info = registry._REGISTRY[other]
    try:
        registry._REGISTRY[other] = dataclasses.replace(info, cost=lambda *a: 0.0)
        assert choose(model, 8, 1 << 20, [8000] * 8, 4, names) == other
    finally:
        registry._REGISTRY[other] = info
    assert choose(model, 8, 1 << 20, [8000] * 8, 4, names) == before
