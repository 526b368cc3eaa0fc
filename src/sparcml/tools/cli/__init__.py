"""The ``sparcml`` command line: one module per command family.

Each family module (:mod:`.bench`, :mod:`.train`, :mod:`.simulate`,
:mod:`.cluster`, :mod:`.ina`) registers its commands with ``add_parsers(sub)``;
every command's parser carries its handler (``run``). Handlers import what they
need when they run, so ``sparcml --help`` starts fast. Only the CLI prints.

* ``sparcml demo`` — the main job: local ranks reduce gradient-like sparse
  vectors with every algorithm and with a dense allreduce, check each result
  against the dense sum and print a table.
* ``sparcml bench``, ``bench-plot``, ``bench-topk``, ``bench-compress``,
  ``bench-faults``, ``algorithms`` — benchmarks and listings;
* ``sparcml train``, ``methods`` — the training recipes;
* ``sparcml simulate`` — the simulator;
* ``sparcml calibrate``, ``cluster`` — calibration and the emulated cluster;
* ``sparcml ina-server``, ``bench-ina``, ``ina-fuzz``, ``ina-stats`` — in-network aggregation.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, cluster, ina, simulate, train

__all__ = ["build_parser", "main"]

FAMILIES = (bench, train, ina, simulate, cluster)


def build_parser() -> argparse.ArgumentParser:
    """The ``sparcml`` command's parser, every sub-command on it (parsing runs nothing)."""
    parser = argparse.ArgumentParser(
        prog="sparcml", description="Sparse and compressed gradient collectives for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparcml`` command."""
    from ...comm.hostmem import enable_huge_pages, keep_freed_memory

    enable_huge_pages()  # before any large tensor (see sparcml.comm.hostmem)
    keep_freed_memory()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # a typo in a sub-command's option: that sub-command's usage, not the top level's
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.command_line = list(argv) if argv is not None else None
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
