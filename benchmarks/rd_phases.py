r"""Where one ``ssar_recursive_double`` call spends its time and CPU, step by step, per rank.

Issue 35, item 1, for recursive doubling (paper 000, sec. 5.3.1): run as the ranks
of a torch.distributed job, this wraps the steps of each exchange-and-add stage
with a clock and with the process's user and system CPU time (every thread;
:mod:`sparcml.tools.bench.phases`) and prints, for each rank, the median over
``--calls`` calls (after a barrier each) of the per-call sums of

* ``total``: the whole ``sparse_allreduce`` call;
* ``1 encode``: encoding the partial sum (every stage);
* ``2 sendrecv``: the exchange with the partner, from posting to the partner's
  message in hand;
* ``3 decode``: decoding the partner's message;
* ``4 add``: merging the two partial sums.

    sparcml cluster -P 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/rd_phases.py -N 16M -d 0.00781 --calls 21
"""

from __future__ import annotations

from typing import Any

from sparcml.collectives.codec import StreamCodec
from sparcml.stream import SparseStream
from sparcml.tools.bench.phases import Phases, phase_job


def wrap(phases: Phases, comm: Any) -> None:
    timed = phases.timed
    StreamCodec.encode = timed("1 encode", StreamCodec.encode)  # type: ignore[method-assign]
    StreamCodec.decode = timed("3 decode", StreamCodec.decode)  # type: ignore[method-assign]
    SparseStream.__add__ = timed("4 add", SparseStream.__add__)  # type: ignore[method-assign]
    comm.sendrecv = timed("2 sendrecv", comm.sendrecv)


def main() -> None:
    lines = phase_job(__doc__, "ssar_recursive_double", wrap, calls=21)
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
