r"""sparcml's all-to-all of unknown sizes next to gloo's, for eager first messages of a given size.

Issue 35, item 1: the split phase of ``ssar_split_allgather`` is an all-to-all of
pieces whose sizes the receivers do not know (``Communicator.alltoallv``). Over
gloo each message is a first message of ``EAGER_BYTES`` (length word and the
payload's start) and, for a longer payload, its rest, whose receive can only be
posted once the length is in. Run as the ranks of a torch.distributed job, this
times (slowest rank per call, after a barrier) for pieces of a few sizes:

* gloo's ``all_to_all_single`` (sizes known everywhere);
* ``TorchDistCommunicator.alltoallv`` with ``--eager`` bytes of first message
  (default: the library's, ``eager_bytes(P)``; every rank sets the same);
* plain ``isend``/``irecv`` of the known sizes.

    sparcml cluster -P 8 --rate 1gbit -- \
        .venv/bin/python benchmarks/alltoallv_eager.py --eager 65536
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transport_floor import slowest_rank_timer  # this folder, on sys.path when run as a script

from sparcml.comm import TorchDistCommunicator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eager", type=int, default=None, help="bytes of the first message")
    ap.add_argument("--sizes", default="16000,84000,200000", help="bytes a peer, comma-separated")
    ap.add_argument("--calls", type=int, default=9)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    p, me = dist.get_world_size(), dist.get_rank()
    comm = TorchDistCommunicator()
    if args.eager is not None:
        comm.eager_bytes = args.eager

    timeit = slowest_rank_timer(args.calls)

    if me == 0:
        print(f"P={p}, first message {comm.eager_bytes} bytes", flush=True)
    for nbytes in (int(x) for x in args.sizes.split(",")):
        parts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(p)]
        flat_in = torch.zeros(nbytes * p, dtype=torch.uint8)
        flat_out = torch.empty_like(flat_in)
        timeit(
            f"gloo all_to_all_single, {nbytes} B a peer",
            lambda o=flat_out, i=flat_in: dist.all_to_all_single(o, i),
        )
        timeit(f"comm.alltoallv, {nbytes} B a peer", lambda parts=parts: comm.alltoallv(parts))

        def known(parts: list[torch.Tensor] = parts, nbytes: int = nbytes) -> None:
            sends = [dist.isend(parts[(me + s) % p], (me + s) % p) for s in range(1, p)]
            recvs = [
                dist.irecv(torch.empty(nbytes, dtype=torch.uint8), (me - s) % p)
                for s in range(1, p)
            ]
            for w in recvs + sends:
                w.wait()

        timeit(f"isend/irecv of known sizes, {nbytes} B a peer", known)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
