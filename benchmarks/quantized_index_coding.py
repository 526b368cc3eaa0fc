r"""Bytes and coding time of one quantized sparse message per index coding.

A stream of ``k`` uniform random indices below ``N`` with float32 values, its
values quantized by ``--quantizer`` (natural compression by default), encoded
as :func:`sparcml.compress.base.encode_quantized_stream` does with each index
coding: ``fixed`` (sec. 5.1's ``c``-byte fields), ``delta`` (LEB128 varints of
the gaps) and ``elias-fano`` (the Elias--Fano field where it is smaller than the
fixed fields, the library's choice for quantized CPU messages under
``index_coding="auto"``). Prints the message's bytes, bytes per index, and the
encode and decode times (p50 of ``--repeats``, one thread), then the load
average.

    .venv/bin/python benchmarks/quantized_index_coding.py -N 1M -k 5000,50000
"""

from __future__ import annotations

import argparse
import os

import torch
from split_local_work import p50_ms  # this folder, on sys.path when run as a script

from sparcml import SparseStream, compress
from sparcml.compress.base import decode_quantized_stream, encode_quantized_stream
from sparcml.tools.cli.common import size_arg

CODINGS = ("fixed", "delta", "elias-fano")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-N", "--size", type=size_arg, default=1 << 20)
    ap.add_argument("-k", "--nnz", default="5000,50000", help="indices, comma-separated")
    ap.add_argument("--quantizer", default="natural")
    ap.add_argument("--repeats", type=int, default=101)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, q, cpu = args.size, compress.get(args.quantizer), torch.device("cpu")
    print(f"N={n:,}, {args.quantizer} values, one thread, p50 of {args.repeats}")
    head = ("k", "coding", "bytes", "B/index", "encode ms", "decode ms")
    print("{:>9} {:<11} {:>9} {:>8} {:>10} {:>10}".format(*head))
    for k in (int(x) for x in args.nnz.split(",")):
        g = torch.Generator().manual_seed(k)
        idx = torch.randperm(n, generator=g)[:k].sort().values
        stream = SparseStream.from_sorted(idx, torch.randn(k, generator=g), n)
        values_nbytes = q.expected_nbytes(k)
        for coding in CODINGS:
            gen = torch.Generator().manual_seed(0)

            def enc(s: SparseStream = stream, c: str = coding, r: torch.Generator = gen) -> object:
                return encode_quantized_stream(s, q, r, c)

            msg = enc()
            assert isinstance(msg, torch.Tensor)

            def dec(m: torch.Tensor = msg) -> SparseStream:
                return decode_quantized_stream(m, q, torch.float32, cpu)

            assert torch.equal(dec().indices, idx), f"{coding} lost indices"
            enc_ms, dec_ms = p50_ms(enc, args.repeats), p50_ms(dec, args.repeats)
            per_index = (msg.numel() - values_nbytes - 24) / k
            row = (k, coding, msg.numel(), per_index, enc_ms, dec_ms)
            print("{:>9,} {:<11} {:>9,} {:>8.3f} {:>10.3f} {:>10.3f}".format(*row))
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
