r"""Where one two-level call spends its time and CPU, step by step, per rank.

Issue 31: run as the ranks of a torch.distributed job on nodes (``sparcml cluster
--nodes N --ranks-per-node L``), this wraps ``twolevel_shard``'s steps with a clock
and the process's user and system CPU time (every thread, gloo's included;
:mod:`sparcml.tools.bench.phases`) and prints, for each rank, the median over
``--calls`` calls (after a barrier each) of

* ``0 total``: the whole ``sparse_allreduce`` call (the header exchange included);
* ``1 split``: step 1, the reduce-scatter inside the node;
* ``2 inner``: step 2, the shard's allreduce between nodes;
* ``3 allgather``: step 3's allgather of the reduced shards inside the node;
* ``4 decode``: step 3's decoding of the gathered shards into the result.

``--index-coding elias-fano`` codes every message with Elias--Fano (what ``auto``
did inside the node before it sent the fixed fields there); ``auto`` is the default.

    sparcml cluster --nodes 2 --ranks-per-node 4 --rate 1gbit -- \
        .venv/bin/python benchmarks/twolevel_phases.py -N 16M -d 0.00781 --index-coding auto
"""

from __future__ import annotations

from typing import Any

import sparcml.collectives.twolevel_shard as shard
from sparcml.tools.bench.phases import Phases, phase_job


def wrap(phases: Phases, comm: Any) -> None:
    timed, inner = phases.timed, shard.get_algorithm
    shard.split_and_reduce = timed("1 split", shard.split_and_reduce)
    shard.get_algorithm = lambda name: timed("2 inner", inner(name))
    shard.allgather_buffers = timed("3 allgather", shard.allgather_buffers)
    shard.decode_ranges = timed("4 decode", shard.decode_ranges)


def main() -> None:
    lines = phase_job(__doc__, "twolevel_shard", wrap, calls=15)
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
