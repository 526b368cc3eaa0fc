"""Training recipes: ``train``, ``methods``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import add_env_arg, fraction_arg, positive_arg

__all__ = ["add_parsers"]


def train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ...torch.peers import is_peer
    from ..recipes import RECIPES
    from ..recipes.data import DataMissingError
    from ..recipes.train import (
        CONFIG_PREFIX,
        FSDP_ON_CPU_ONLY,
        check_device,
        format_table,
        run_recipe,
        write_report,
    )

    recipe = RECIPES[args.recipe]
    if args.config:
        checked = _check_config(args)
        if checked is not None:
            return checked
    default = [] if args.config else list(recipe.methods)  # --config alone: its run only
    chosen = args.methods.split(",") if args.methods else default
    for m in chosen:
        if m.startswith(CONFIG_PREFIX):
            continue
        if not is_peer(m) and not _is_method(m):
            print(
                f"sparcml train: unknown method {m!r}; see `sparcml methods` (PyTorch's own: "
                "ddp, fp16, bf16, powersgd, powersgdR)",
                file=sys.stderr,
            )
            return 2
    try:
        check_device(args.device)
    except ValueError as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    if args.fsdp and args.device != "cpu":
        print(f"sparcml train: {FSDP_ON_CPU_ONLY}", file=sys.stderr)
        return 2
    if args.layers:
        try:
            _layer_rules(args.layers)
        except ValueError as e:
            print(f"sparcml train: --layers: {e}", file=sys.stderr)
            return 2
    if args.density_warmup and args.density > 0.25:
        print("sparcml train: --density-warmup starts at 25%: give --density below it",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.config:
        chosen.append(CONFIG_PREFIX + Path(args.config).name)
    if args.from_json:
        return rewrite_report(args)
    if args.cluster or args.env:
        return train_tta(args, chosen)
    hyper = _hyper(args)
    options: dict = {"limit": args.limit} if args.limit else {}
    try:
        options.update(_recipe_options(args, chosen))
    except ValueError as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    if args.density_warmup:
        options["density_warmup"] = args.density_warmup
    if args.fsdp and any(is_peer(m) for m in chosen):
        print("sparcml train: PyTorch's hooks (ddp, fp16, bf16, powersgd) are DDP-only; "
              "drop --fsdp", file=sys.stderr)  # fmt: skip
        return 2
    if args.fsdp:
        from ...torch.methods import method_spec

        if not args.methods:
            chosen = [m for m in chosen if method_spec(m).scatter is not None]
        for m in chosen:
            if method_spec(m).scatter is None:
                print(f"sparcml train: {m!r} has no FSDP reduce-scatter", file=sys.stderr)
                return 2
        options["fsdp"] = True
    if args.eval_every:
        options["eval_every"] = args.eval_every or -1  # -1: about 15 evaluations per run
    elif (args.epochs or recipe.epochs) <= 2:
        # a short run: about 15 evaluations, so that the accuracy curve has points (an
        # evaluation per epoch gives one or two); the training clock stops meanwhile
        options["eval_every"] = -1
    if args.probe_steps:
        options["probe_steps"] = args.probe_steps
    if args.device != "cpu":
        options["device"] = args.device
    options.update(_stop_options(args))
    if args.seeds:
        print("sparcml train: --seeds runs with --cluster; use --seed on local ranks",
              file=sys.stderr)  # fmt: skip
        return 2
    command = "sparcml " + " ".join(
        sys.argv[1:] if args.command_line is None else args.command_line
    )
    try:
        result = run_recipe(
            args.recipe, chosen, args.world_size, args.epochs, hyper, args.seed, options,
            progress=not args.quiet,
        )  # fmt: skip
    except (DataMissingError, ValueError) as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a rank failed: its traceback is in the message
        if type(e).__name__ != "ProcessFailedError":
            raise
        print(f"sparcml train: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    out = Path(args.out or f"bench-results/train/{args.recipe}")
    for path in write_report(result, out, command):
        print(f"wrote {path}")
    return 0


def _recipe_options(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    """``--recipe-option KEY=VALUE`` (repeated) as the recipe's options, numbers parsed.

    Raises:
        ValueError: not KEY=VALUE, a key the recipe does not take, or options the
            recipe cannot train ``methods`` with (its ``check_methods``).
    """
    from ..recipes import RECIPES

    allowed = RECIPES[args.recipe].options_taken
    out: dict[str, Any] = {}
    for item in args.recipe_option or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--recipe-option: expected KEY=VALUE, got {item!r}")
        if key not in allowed:
            raise ValueError(
                f"--recipe-option: {args.recipe} takes no option {key!r}; it takes "
                f"{', '.join(allowed) or 'none'}"
            )
        parsed: Any = value
        for kind in (int, float):
            try:
                parsed = kind(value)
                break
            except ValueError:
                continue
        out[key] = parsed
    RECIPES[args.recipe].check_methods(methods, out)
    return out


def _stop_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--stop-after`` / ``--target`` as the harness's options."""
    out: dict[str, Any] = {}
    if args.stop_after:
        out["stop_after"] = args.stop_after
    if args.target is not None:
        out["target"] = args.target
    return out


def _seeds(text: str | None, default: int) -> list[int]:
    """``--seeds 0,1,2`` as a list (``[--seed]`` without it).

    Raises:
        ValueError: not a comma-separated list of distinct integers.
    """
    if not text:
        return [default]
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {text!r} names a seed twice")
    return seeds


def _check_config(args: argparse.Namespace) -> int | None:
    """``--config FILE`` read and checked here, with the keywords' messages (exit 2 on
    an error); None when it is fine."""
    from ...torch import SparcmlState
    from ...torch.config import load_config

    if args.cluster or args.env:
        print("sparcml train: --config runs on local ranks; with --cluster/--env name "
              "the methods with --methods", file=sys.stderr)  # fmt: skip
        return 2
    if args.density_warmup or args.layers:
        print("sparcml train: --config carries its own density schedule and layer rules; "
              "drop --density-warmup / --layers", file=sys.stderr)  # fmt: skip
        return 2
    try:
        SparcmlState(**load_config(args.config))  # a world of one: checks, no traffic
    except (OSError, ImportError, TypeError, ValueError) as e:
        print(f"sparcml train: --config: {e}", file=sys.stderr)
        return 2
    return None


def _is_method(name: str) -> bool:
    from ...torch.methods import method_kind

    try:
        method_kind(name)
    except ValueError:
        return False
    return True


def _layer_rules(text: str) -> list[tuple[str, str]]:
    """``"*.bias=dense,emb.*=nonzeros"`` as (pattern, method) pairs, methods checked."""
    from ...torch.methods import method_kind

    rules = []
    for part in text.split(","):
        pattern, eq, method = part.partition("=")
        if not eq or not pattern.strip() or not method.strip():
            raise ValueError(f"expected PATTERN=METHOD, got {part!r}")
        method_kind(method.strip())  # ValueError naming the choices
        rules.append((pattern.strip(), method.strip()))
    return rules


def _hyper(args: argparse.Namespace) -> dict:
    hyper: dict = {"density": args.density}
    if args.warmup_steps:
        hyper["warmup_steps"] = args.warmup_steps
    if args.momentum_correction is not None:
        hyper["momentum"] = args.momentum_correction
    if args.momentum_masking is not None:
        hyper["momentum_masking"] = args.momentum_masking
    if args.index_coding != "auto":
        hyper["index_coding"] = args.index_coding
    if args.algorithm:
        hyper["algorithm"] = args.algorithm
    if args.layers:
        hyper["layers"] = _layer_rules(args.layers)
    if args.dense_below:
        hyper["dense_below"] = args.dense_below
    if args.config:
        from pathlib import Path

        hyper["config"] = str(Path(args.config).resolve())
    return hyper


def _child_args(args: argparse.Namespace) -> list[str]:
    """The options every rank of a cluster job gets (all but the methods and outputs)."""
    out = ["-d", str(args.density), "--seed", str(args.seed), "--index-coding", args.index_coding]
    if args.device != "cpu":
        out += ["--device", args.device]
    for flag, value in (
        ("--epochs", args.epochs), ("--limit", args.limit), ("--warmup-steps", args.warmup_steps),
        ("--eval-every", args.eval_every), ("--layers", args.layers),
        ("--dense-below", args.dense_below), ("--density-warmup", args.density_warmup),
        ("--algorithm", args.algorithm),
    ):  # fmt: skip
        if value:
            out += [flag, str(value)]
    # (0 means something here: no momentum correction, no probe)
    for flag, value in (
        ("--momentum-correction", args.momentum_correction), ("--probe-steps", args.probe_steps),
    ):  # fmt: skip
        if value is not None:
            out += [flag, str(value)]
    if args.momentum_masking is not None:
        out.append("--momentum-masking" if args.momentum_masking else "--no-momentum-masking")
    for item in args.recipe_option or []:
        out += ["--recipe-option", item]
    return out + (["-q"] if args.quiet else [])


def rewrite_report(args: argparse.Namespace) -> int:
    """``--from-json``: the time-to-accuracy report again from a results.json."""
    import json
    from pathlib import Path

    from ..recipes.tta import (
        format_predictions,
        format_tta_table,
        load_result,
        parse_rate,
        write_tta_report,
    )

    if Path(args.from_json).is_dir():
        return _rewrite_seeds(args, Path(args.from_json))
    try:
        result = load_result(args.from_json)
        command = json.loads(Path(args.from_json).read_text())["command"]
    except (OSError, KeyError, ValueError) as e:
        print(f"sparcml train: --from-json: {e}", file=sys.stderr)
        return 2
    rate = result.get("link_rate")
    rate_bps = parse_rate(rate) if rate else None
    print(format_tta_table(result, rate_bps))
    predict = _predict_rates(args, rate_bps)
    if predict is None:
        return 2
    if predict:
        print(format_predictions(result, rate_bps or 0.0, predict))
    out = Path(args.out or Path(args.from_json).parent)
    for path in write_tta_report(result, out, command, rate_bps, predict):
        print(f"wrote {path}")
    return 0


def _rewrite_seeds(args: argparse.Namespace, root: Any) -> int:
    """``--from-json DIR`` of a ``--seeds`` run: every seed's report and the medians
    again, in place, from the ``seedS/results.json`` files."""
    import json

    from ..recipes.tta import load_result, parse_rate, write_seeds_report, write_tta_report

    paths = sorted(root.glob("seed*/results.json"), key=lambda p: int(p.parent.name[4:]))
    if not paths:
        print(f"sparcml train: --from-json: {root} holds no seed*/results.json", file=sys.stderr)
        return 2
    results = []
    for path in paths:
        result = load_result(path)
        command = json.loads(path.read_text())["command"]
        rate = result.get("link_rate")
        rate_bps = parse_rate(rate) if rate else None
        predict = _predict_rates(args, rate_bps)
        if predict is None:
            return 2
        for written in write_tta_report(result, path.parent, command, rate_bps, predict):
            print(f"wrote {written}")
        results.append(result)
    for written in write_seeds_report(results, root, command, rate_bps):
        print(f"wrote {written}")
    return 0


def _predict_rates(args: argparse.Namespace, rate_bps: float | None) -> list[str] | None:
    """``--predict`` checked: its rates, ``[]`` without it, None (after saying why on
    stderr) when it cannot apply."""
    from ..recipes.tta import parse_rate

    if not args.predict:
        return []
    rates = [r.strip() for r in args.predict.split(",") if r.strip()]
    try:
        for r in rates:
            parse_rate(r)
    except ValueError as e:
        print(f"sparcml train: --predict: {e}", file=sys.stderr)
        return None
    if not rate_bps:
        print("sparcml train: --predict needs runs on a shaped link (--cluster, or a "
              "results.json of one): a loopback run has no link time to take out",
              file=sys.stderr)  # fmt: skip
        return None
    return rates


def train_tta(args: argparse.Namespace, chosen: list[str]) -> int:
    """``--env`` (one rank of a job) and ``--cluster P`` (a job per method on an
    emulated cluster): the time-to-accuracy report."""
    import json
    import logging
    import os
    from pathlib import Path

    from ..recipes.data import DataMissingError
    from ..recipes.train import join_recipe
    from ..recipes.tta import (
        format_predictions,
        format_tta_table,
        parse_rate,
        run_on_cluster,
        write_tta_report,
    )

    if args.cluster and args.env:
        print("sparcml train: --cluster starts the jobs, --env joins one: not both",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.fsdp:
        print("sparcml train: --cluster/--env run DDP; drop --fsdp", file=sys.stderr)
        return 2
    rate = args.rate if args.cluster else os.environ.get("SPARCML_CLUSTER_RATE")
    try:
        rate_bps = parse_rate(rate) if rate else None
    except ValueError as e:
        print(f"sparcml train: --rate: {e}", file=sys.stderr)
        return 2
    predict = _predict_rates(args, rate_bps)
    if predict is None:
        return 2
    if args.cluster and os.geteuid() != 0:
        print("sparcml train: --cluster needs root (network namespaces and tc); run it with "
              "sudo, or start the job yourself: sudo sparcml cluster -P 4 --rate 100mbit -- "
              "sparcml train RECIPE --env --out DIR", file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=logging.INFO if not args.quiet else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout)  # fmt: skip
    options: dict = {"limit": args.limit} if args.limit else {}
    try:
        options.update(_recipe_options(args, chosen))
    except ValueError as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    options["eval_every"] = args.eval_every or -1  # -1: about 15 evaluations per run
    options["probe_steps"] = args.probe_steps
    options["line_progress"] = True
    if args.device != "cpu":
        options["device"] = args.device
    if args.density_warmup:
        options["density_warmup"] = args.density_warmup
    options.update(_stop_options(args))
    command = "sparcml " + " ".join(
        sys.argv[1:] if args.command_line is None else args.command_line
    )
    try:
        seeds = _seeds(args.seeds, args.seed)
    except ValueError as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    if args.seeds and not args.cluster:
        print("sparcml train: --seeds starts a job per seed: use it with --cluster",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.seeds and not args.out:
        print("sparcml train: --seeds writes a report per seed: give --out DIR", file=sys.stderr)
        return 2
    try:
        if args.cluster and args.seeds:
            return _train_seeds(args, chosen, seeds, command, rate_bps, predict)
        if args.cluster:
            result = run_on_cluster(
                args.recipe, chosen, args.cluster, args.rate, _child_args(args),
                timeout=args.timeout, log_dir=args.log_dir, stop_after=args.stop_after or 0,
                target=args.target, ranks_per_node=args.ranks_per_node,
            )  # fmt: skip
        else:
            result = join_recipe(
                args.recipe, chosen, args.epochs, _hyper(args), args.seed, options,
                progress=not args.quiet,
            )  # fmt: skip
    except (DataMissingError, ValueError) as e:
        print(f"sparcml train: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if type(e).__name__ == "ClusterError" or "job failed" in str(e) or "every job" in str(e):
            print(f"sparcml train: {e}", file=sys.stderr)
            return 1
        raise
    if result is None:  # not rank 0
        return 0
    result["options"] = {k: v for k, v in result["options"].items() if k != "line_progress"}
    if args.run_json:
        Path(args.run_json).write_text(json.dumps(result, default=str))
    print(format_tta_table(result, rate_bps))
    if predict and rate_bps:
        print(format_predictions(result, rate_bps, predict))
    if args.out:
        for path in write_tta_report(result, Path(args.out), command, rate_bps, predict):
            print(f"wrote {path}")
    elif not args.run_json:
        print("(no --out: nothing written)")
    return 0


def _train_seeds(
    args: argparse.Namespace, chosen: list[str], seeds: list[int], command: str,
    rate_bps: float | None, predict: list[str],
) -> int:  # fmt: skip
    """``--cluster --seeds``: the comparison once per seed (``DIR/seedS``), then the
    medians and ranges over the seeds (``DIR/results.md``, ``DIR/seeds.json``). The
    methods after the baseline run in an order rotated by one place per seed
    (:func:`~sparcml.tools.recipes.tta.run_on_cluster`'s ``rotate``)."""
    from pathlib import Path

    from ..recipes.tta import format_tta_table, run_on_cluster, write_seeds_report, write_tta_report

    out = Path(args.out)
    results = []
    for place, seed in enumerate(seeds):
        child = _child_args(args)
        child[child.index("--seed") + 1] = str(seed)
        result = run_on_cluster(
            args.recipe, chosen, args.cluster, args.rate, child, timeout=args.timeout,
            log_dir=f"{args.log_dir}/seed{seed}" if args.log_dir else None,
            stop_after=args.stop_after or 0, target=args.target,
            ranks_per_node=args.ranks_per_node, rotate=place,
        )  # fmt: skip
        result["seed"] = seed
        print(f"seed {seed}:")
        print(format_tta_table(result, rate_bps))
        for path in write_tta_report(result, out / f"seed{seed}", command, rate_bps, predict):
            print(f"wrote {path}")
        results.append(result)
    for path in write_seeds_report(results, out, command, rate_bps):
        print(f"wrote {path}")
    return 0


def list_methods(args: argparse.Namespace) -> int:
    from ...torch.state import methods

    for name, text in methods().items():
        print(f"{name:<28} {text}")
    print(
        f"{'SELECTOR+QUANTIZER':<28} sparse: a selector above, then a quantizer on what it "
        "selected (topk+natural, topk+qsgd, ...): SparCML's quantized TopK SGD (Alg. 1)"
    )
    print(
        f"{'ddp, powersgd, powersgdR':<28} PyTorch's own allreduce and PowerSGD hook (rank 2 or "
        "R), by name in register() and sparcml train (where fp16/bf16 are PyTorch's hooks)"
    )
    return 0


def add_parsers(sub: Any) -> None:
    """Register this family's commands on the ``sparcml`` subparsers."""
    tr = sub.add_parser(
        "train",
        help="train a recipe on real data with dense and each sparcml method",
        description="Trains the recipe's model on local gloo ranks with DDP, once per method "
        "(the method as the DDP communication hook), and writes a results table and plots.",
    )
    from ..recipes import RECIPES

    tr.add_argument("recipe", choices=sorted(RECIPES))
    tr.add_argument("--methods", help="comma-separated (default: the recipe's applicable ones)")
    tr.add_argument(
        "--config",
        metavar="FILE",
        help="a JSON or YAML config (sparcml.torch.config: method, density, layers, ...), "
        "trained as one more run named config:FILE (alone unless --methods is given); "
        "--density, --warmup-steps and the other method options do not apply to it",
    )
    tr.add_argument("-P", "--world-size", type=positive_arg, default=4)
    tr.add_argument("--epochs", type=positive_arg, help="default: the recipe's")
    tr.add_argument("-d", "--density", type=fraction_arg, default=0.01)
    tr.add_argument("--warmup-steps", type=int, default=0, help="dense steps first")
    tr.add_argument(
        "--density-warmup",
        type=positive_arg,
        metavar="EPOCHS",
        help="DGC's density warm-up: 25%% in the first epoch, falling exponentially to "
        "--density over EPOCHS epochs (DGC: 4)",
    )
    tr.add_argument(
        "--layers",
        metavar="RULES",
        help="per-layer methods, first match wins: PATTERN=METHOD[,...] on parameter "
        "names, e.g. '*.bias=dense,*norm*=dense' (sparcml.torch.LayerRule)",
    )
    tr.add_argument(
        "--dense-below",
        type=int,
        default=0,
        metavar="N",
        help="parameters with fewer than N entries are sent dense (CGX's layer_min_size)",
    )
    tr.add_argument(
        "--index-coding",
        choices=["auto", "fixed", "elias-fano", "delta"],  # sparcml.collectives.codec.INDEX_CODINGS
        default="auto",
        help="how the sparse methods' indices travel: auto (Elias-Fano where smaller, for CPU "
        "tensors), fixed (c-byte words), elias-fano (where smaller, on every device), delta "
        "(auto, and quantized messages' indices as varints of the gaps)",
    )
    tr.add_argument(
        "--momentum-correction",
        type=float,
        default=None,
        help="DGC momentum correction with this momentum for the sparse methods (default: "
        "the recipe's optimizer momentum, 0.9 for fmnist and shakespeare, none for the plain "
        "SGD of newsgroups and wordlm; the optimizer then runs without momentum). 0 gives "
        "the momentum back to the optimizer, over error feedback (PowerSGD's arrangement)",
    )
    tr.add_argument(
        "--momentum-masking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DGC's momentum factor masking with momentum correction (default: the "
        "state's, see docs/training.md)",
    )
    tr.add_argument(
        "--limit",
        type=positive_arg,
        help="use only this many training samples (images, documents, or 64-character "
        "sequences for shakespeare); refused if too few for one step per epoch",
    )
    tr.add_argument(
        "--recipe-option",
        action="append",
        metavar="KEY=VALUE",
        help="an option of the recipe (repeatable): newsgroups features=N (hash buckets), "
        "wordlm vocab=N, width=N, lr=X",
    )
    tr.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard) instead of DDP: the method is the compressed "
        "reduce-scatter (sparcml.torch.register_fsdp)",
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--seeds",
        metavar="S,S,...",
        help="with --cluster: the whole comparison once per seed (initialisation and data "
        "order), each in DIR/seedS, and a table of the medians and ranges in DIR",
    )
    tr.add_argument(
        "--stop-after",
        type=positive_arg,
        metavar="K",
        help="stop a method once K evaluations in a row reached the target (default "
        "target: within 1 point / 3%% of the dense baseline's final figure; the baseline, "
        "ddp or dense, then runs first and whole)",
    )
    tr.add_argument(
        "--target",
        type=float,
        help="the test figure --stop-after stops at (accuracy as a fraction, perplexity)",
    )
    tr.add_argument(
        "--out",
        help="output directory (default bench-results/train/RECIPE under the current "
        "directory, ignored by git; the committed tables live in docs/results/train)",
    )
    tr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    tr.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda (cuda:N): the model, its gradients and the method's "
        "codec on a GPU, each rank on GPU LOCAL_RANK (or its rank) modulo the GPUs; the "
        "collectives still go over gloo, through host memory",
    )
    add_env_arg(tr)
    tr.add_argument(
        "--cluster",
        type=positive_arg,
        metavar="P",
        help="run each method as a job on a fresh emulated cluster of P hosts (root; "
        "sparcml cluster) and write the time-to-accuracy report",
    )
    tr.add_argument("--ranks-per-node", type=positive_arg, default=1,
                    help="with --cluster: P/L hosts of L ranks sharing one shaped NIC "
                    "(default 1); auto then weighs the two-level algorithms")  # fmt: skip
    tr.add_argument("--algorithm", help="the sparse allreduce algorithm of the sparcml "
                    "methods that run one (default auto)")  # fmt: skip
    tr.add_argument("--rate", default="100mbit", help="link rate with --cluster (tc syntax, "
                    "default 100mbit)")  # fmt: skip
    tr.add_argument("--timeout", type=float, default=3600.0,
                    help="with --cluster: stop a method's job after this many seconds")  # fmt: skip
    tr.add_argument("--log-dir", help="with --cluster: keep every rank's output here")
    tr.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate every so many steps and before the first (the training clock "
        "stops meanwhile); default: about 15 evaluations per run with --cluster/--env or "
        "for runs of at most 2 epochs, else one at the end of each epoch",
    )
    tr.add_argument(
        "--probe-steps",
        type=int,
        default=20,
        help="after training, time this many forward+backward passes without "
        "communication: the compute part of a step (0: skip)",
    )
    tr.add_argument(
        "--predict",
        metavar="RATES",
        help="also predict each method's time per step and to the target on these links "
        "(e.g. 10mbit,100mbit,1gbit,10gbit) from the measured split: compute, optimizer "
        "and the sync beyond the link kept, bytes and messages costed at each rate; with "
        "--cluster or --from-json",
    )
    tr.add_argument("--run-json", help=argparse.SUPPRESS)
    tr.add_argument(
        "--from-json",
        help="write the time-to-accuracy report again from a results.json (into --out, "
        "default: its directory), or from the directory of a --seeds run (every seed's "
        "report and the medians, in place); trains nothing",
    )
    tr.set_defaults(run=train)
    _p = sub.add_parser("methods", help="list the gradient synchronisation methods")
    _p.set_defaults(run=list_methods)
