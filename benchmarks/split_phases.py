r"""Where one ``ssar_split_allgather`` call spends its time and CPU, phase by phase, per rank.

Issue 35, item 1: run as the ranks of a torch.distributed job, this wraps the
algorithm's steps (paper 000, sec. 5.3.2) with a clock and with the process's
user and system CPU time (every thread: gloo's included;
:mod:`sparcml.tools.bench.phases`) and prints, for each rank, the median over
``--calls`` calls (after a barrier each) of

* ``total``: the whole ``sparse_allreduce`` call;
* ``1 split+reduce``: steps 1-2 (encode the pieces, the all-to-all, decode and sum
  this rank's range); ``1a alltoallv``: the all-to-all alone;
* ``3 allgather``: the recursive-doubling allgather of the reduced ranges;
* ``4 decode``: decoding the gathered ranges into the result.

    sparcml cluster -P 8 --rate 1gbit -- \
        .venv/bin/python benchmarks/split_phases.py -N 16M -d 0.00781 --index-coding auto
"""

from __future__ import annotations

from typing import Any

import sparcml.collectives.ssar_split_allgather as split_allgather
from sparcml.tools.bench.phases import Phases, phase_job


def wrap(phases: Phases, comm: Any) -> None:
    timed = phases.timed
    split_allgather.split_and_reduce = timed("1 split+reduce", split_allgather.split_and_reduce)
    split_allgather.allgather_buffers = timed("3 allgather", split_allgather.allgather_buffers)
    split_allgather.decode_ranges = timed("4 decode", split_allgather.decode_ranges)
    comm.alltoallv = timed("1a alltoallv", comm.alltoallv)


def main() -> None:
    lines = phase_job(__doc__, "ssar_split_allgather", wrap, calls=9)
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
