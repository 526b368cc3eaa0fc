"""Training recipes: ``train``, ``methods``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import fraction_arg, positive_arg

__all__ = ["add_parsers"]


def train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ...torch.state import methods as known_methods
    from ..recipes import RECIPES
    from ..recipes.data import DataMissingError
    from ..recipes.train import format_table, run_recipe, write_report

    recipe = RECIPES[args.recipe]
    chosen = args.methods.split(",") if args.methods else list(recipe.methods)
    valid = known_methods()
    for m in chosen:
        parts = m.split("+")
        if m not in valid and not (len(parts) == 2 and all(p in valid for p in parts)):
            print(f"sparcml train: unknown method {m!r}; see `sparcml methods`", file=sys.stderr)
            return 2
    hyper: dict = {"density": args.density}
    if args.warmup_steps:
        hyper["warmup_steps"] = args.warmup_steps
    if args.momentum_correction is not None:
        hyper["momentum"] = args.momentum_correction
    if args.index_coding != "fixed":
        hyper["index_coding"] = args.index_coding
    if args.layers:
        try:
            hyper["layers"] = _layer_rules(args.layers)
        except ValueError as e:
            print(f"sparcml train: --layers: {e}", file=sys.stderr)
            return 2
    if args.dense_below:
        hyper["dense_below"] = args.dense_below
    options: dict = {"limit": args.limit} if args.limit else {}
    if args.density_warmup:
        if args.density > 0.25:
            print("sparcml train: --density-warmup starts at 25%: give --density below it",
                  file=sys.stderr)  # fmt: skip
            return 2
        options["density_warmup"] = args.density_warmup
    if args.fsdp:
        from ...torch.fsdp import FSDP_METHODS
        from ...torch.state import method_kind

        if not args.methods:
            chosen = [m for m in chosen if method_kind(m) in FSDP_METHODS]
        for m in chosen:
            if method_kind(m) not in FSDP_METHODS:
                print(f"sparcml train: {m!r} has no FSDP reduce-scatter", file=sys.stderr)
                return 2
        options["fsdp"] = True
    command = "sparcml " + " ".join(
        sys.argv[1:] if args.command_line is None else args.command_line
    )
    try:
        result = run_recipe(
            args.recipe, chosen, args.world_size, args.epochs, hyper, args.seed, options,
            progress=not args.quiet,
        )  # fmt: skip
    except DataMissingError as e:
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


def _layer_rules(text: str) -> list[tuple[str, str]]:
    """``"*.bias=dense,emb.*=nonzeros"`` as (pattern, method) pairs, methods checked."""
    from ...torch.state import method_kind

    rules = []
    for part in text.split(","):
        pattern, eq, method = part.partition("=")
        if not eq or not pattern.strip() or not method.strip():
            raise ValueError(f"expected PATTERN=METHOD, got {part!r}")
        method_kind(method.strip())  # ValueError naming the choices
        rules.append((pattern.strip(), method.strip()))
    return rules


def list_methods(args: argparse.Namespace) -> int:
    from ...torch.state import methods

    for name, text in methods().items():
        print(f"{name:<28} {text}")
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
        choices=["fixed", "delta"],
        default="fixed",
        help="indices of quantized sparse messages: c-byte words or varints of the gaps",
    )
    tr.add_argument(
        "--momentum-correction",
        type=float,
        default=None,
        help="DGC momentum correction with this momentum for the sparse methods (default "
        "0.9; the optimizer then runs without momentum). 0 gives the momentum back to the "
        "optimizer, which diverges with error feedback on most recipes",
    )
    tr.add_argument(
        "--limit",
        type=positive_arg,
        help="use only this many training samples (images, documents, or 64-character "
        "sequences for shakespeare); refused if too few for one step per epoch",
    )
    tr.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard) instead of DDP: the method is the compressed "
        "reduce-scatter (sparcml.torch.register_fsdp)",
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--out",
        help="output directory (default bench-results/train/RECIPE under the current "
        "directory, ignored by git; the committed tables live in docs/results/train)",
    )
    tr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(run=train)
    _p = sub.add_parser("methods", help="list the gradient synchronisation methods")
    _p.set_defaults(run=list_methods)
