"""Configuration as data: mappings, JSON and YAML files at every entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fsdp_workers
import sparcml.torch as st
import train_workers
from sparcml.comm.launch import run_processes
from sparcml.torch.config import load_config
from sparcml.torch.rules import DensityWarmup, LayerRule, StepRange

CONFIG = {
    "method": "topk",
    "density": 0.05,
    "momentum": 0.9,
    "layers": [["*.bias", "dense"], {"pattern": "0.*", "method": "topk", "density": 0.2}],
}
YAML = """\
method: topk
density: 0.05
momentum: 0.9
layers:
  - ["*.bias", dense]
  - {pattern: "0.*", method: topk, density: 0.2}
"""


def test_a_mapping_a_json_file_and_a_yaml_file_give_the_same_keywords(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    (tmp_path / "c.yaml").write_text(YAML)
    got = [
        load_config(CONFIG),
        load_config(tmp_path / "c.json"),
        load_config(str(tmp_path / "c.yaml")),
    ]
    assert got[0] == got[1] == got[2]
    assert got[0]["layers"] == [
        LayerRule("dense", pattern="*.bias"),
        LayerRule("topk", pattern="0.*", density=0.2),
    ]
    state = st.SparcmlState.from_config(tmp_path / "c.yaml", density=0.1)  # keywords override
    assert state.method == "topk" and state.density == 0.1 and state.settings.momentum == 0.9


def test_schedules_and_step_ranges_have_a_data_form() -> None:
    cfg = load_config(
        {
            "density": {"warmup": {"steps_per_epoch": 10, "epochs": 2, "start": 0.25, "end": 0.01}},
            "layers": [{"pattern": "fc.*", "method": "dense", "steps": {"from": 5, "until": 8}}],
        }
    )
    assert cfg["density"] == DensityWarmup(steps_per_epoch=10, epochs=2, start=0.25, end=0.01)
    when = cfg["layers"][0].when
    assert when == StepRange(5, 8)
    assert [when(s) for s in (4, 5, 7, 8)] == [False, True, True, False]
    assert StepRange(3)(10**9)  # no end: every step from 3 on


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"layers": "dense"}, "layers must be a list of rules"),
        (
            {"layers": [{"pattern": "x", "method": "dense", "stride": 2}]},
            r"layers\[0\]: unknown rule field\(s\) 'stride'",
        ),
        ({"layers": [{"pattern": "x"}]}, r"layers\[0\]: a rule needs a method"),
        ({"layers": [["x"]]}, r"layers\[0\]: a rule is \[pattern, method\]"),
        ({"layers": [{"method": "dense", "steps": [1, 2]}]}, r"steps is \{'from'"),
        ({"density": {"warmdown": {}}}, "a number, or a schedule"),
        ({"density": "0.1"}, "a number or a warmup schedule"),
        ({"comm": "world"}, "'comm' cannot come from a config"),
        ({"method": 3}, "method must be a method name"),
    ],
)
def test_malformed_configs_are_refused_naming_the_entry(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(config)  # type: ignore[arg-type]


def test_unknown_options_get_the_keywords_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as by_keyword:
        st.SparcmlState("topk", densty=0.1)
    with pytest.raises(ValueError) as by_config:
        st.SparcmlState.from_config({"method": "topk", "densty": 0.1})
    assert str(by_config.value) == str(by_keyword.value)
    with pytest.raises(ValueError, match="unknown method"):
        st.SparcmlState.from_config({"method": "topq"})


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.json").write_text("{method: topk")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("method: [topk")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list\.json: a config is a mapping of options"):
        load_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match="a config file ends in"):
        load_config(tmp_path / "config.toml")
    with pytest.raises(TypeError, match="a config is a mapping or the path"):
        load_config(3)  # type: ignore[arg-type]


def test_comm_hook_takes_a_config() -> None:
    state, _ = st.comm_hook(CONFIG)
    assert state.method == "topk" and state.options["density"] == 0.05


@pytest.mark.spawn
def test_ddp_and_fsdp_registered_from_a_config_file_train_as_with_keywords(tmp_path: Path) -> None:
    path = tmp_path / "sparcml.yaml"
    path.write_text(YAML)
    hyper = {
        "density": 0.05,
        "momentum": 0.9,
        "layers": [("*.bias", "dense"), st.LayerRule("topk", pattern="0.*", density=0.2)],
    }
    by_file = run_processes(2, train_workers.ddp_train, str(path), {}, 4, False, timeout=60)
    by_keyword = run_processes(2, train_workers.ddp_train, "topk", hyper, 4, False, timeout=60)
    for a, b in zip(by_file, by_keyword, strict=True):
        assert torch.equal(a["params"], b["params"])
        assert a["step_bytes"] == b["step_bytes"]
    fsdp = {"method": "topk", "density": 0.1}
    runs = [("file", fsdp, {}), ("keywords", "topk", {"density": 0.1})]
    out = run_processes(2, fsdp_workers.fsdp_runs, runs, 3, timeout=60)
    for o in out:
        assert torch.equal(o["file"]["params"], o["keywords"]["params"])


@pytest.mark.spawn
def test_pytorch_baselines_by_name_are_pytorchs_own_hooks() -> None:
    out = run_processes(2, train_workers.powersgd_runs, 5, timeout=60)
    for o in out:
        assert o["hook_state"] == "PowerSGDState"
        assert torch.equal(o["by name"], o["by hand"])  # PyTorch's hook, as documented
        assert torch.equal(o["by name"], out[0]["by name"])
        assert torch.equal(o["ddp"], o["plain"])  # no hook: DDP's own allreduce
        assert len(o["by name bytes"]) == 5  # PowerSGD's bytes, per step
        assert "takes no options" in o["ddp refuses"]
        assert "only warmup_steps" in o["powersgd refuses"]
    assert not torch.equal(out[0]["by name"], out[0]["plain"])  # PowerSGD compressed


@pytest.mark.spawn
def test_sparcml_train_runs_a_config_file(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from sparcml.tools.cli import main
    from test_recipes import _idx

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 256), ("t10k", 64)):
        _idx(
            tmp_path / f"{split}-images-idx3-ubyte.gz",
            torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8),
        )
        _idx(
            tmp_path / f"{split}-labels-idx1-ubyte.gz",
            torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8),
        )
    monkeypatch.setenv("SPARCML_FMNIST", str(tmp_path))
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(YAML)
    out = tmp_path / "out"
    args = ["train", "fmnist", "-P", "2", "--epochs", "1", "-q", "--probe-steps", "0"]
    assert main([*args, "--config", str(cfg), "--methods", "dense", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "config:mine.yaml" in printed and "dense" in printed
    result = json.loads((out / "results.json").read_text())
    run = result["rows"]["config:mine.yaml"]
    assert run["hyper"] == {"config": str(cfg.resolve())}
    assert len(run["step_bytes"]) > 0
    # a config with an unknown option fails before any rank starts, with its message
    cfg.write_text("method: topk\ndensty: 0.1\n")
    assert main([*args, "--config", str(cfg)]) == 2
    assert "unknown option(s) densty" in capsys.readouterr().err
