"""Every decoder rejects malformed bytes with WireFormatError, and only with it.

40,000 mutated inputs in the default suite (100,000 with
``SPARCML_FUZZ_INPUTS=100000``), round-robin over the decoders a receiver runs on
untrusted bytes: the sparse-stream wire format, bundles, quantized streams (each
quantizer, fixed and delta index coding, sparse and dense), ASQ payloads and the
selectors' payloads. Mutations: random byte flips, truncation, trailing bytes,
header fields (sizes, counts, flags) set to edge values, and index bytes
scrambled (duplicates, unsorted, negative, out of range). A decoder that accepts
a mutated input must return a well-formed stream: strictly increasing indices
in range, as many values as indices.
"""

from __future__ import annotations

import os
import random
import struct

import torch

from sparcml import SparseStream, compress, wire
from sparcml.collectives.codec import StreamCodec
from sparcml.compress.asq import ASQ
from sparcml.compress.base import Context, decode_quantized_stream, encode_quantized_stream
from sparcml.errors import WireFormatError

# 40,000 in the default suite (its time budget); the full campaign:
# SPARCML_FUZZ_INPUTS=100000 pytest tests/test_decoder_fuzz.py
INPUTS = int(os.environ.get("SPARCML_FUZZ_INPUTS", "40000"))


def _stream(n: int, k: int, seed: int) -> SparseStream:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k]
    return SparseStream(idx, torch.randn(k, generator=g), n)


def _decoders() -> list[tuple[str, torch.Tensor, object]]:
    """(name, a valid message, decode function) for every decoder."""
    out: list[tuple[str, torch.Tensor, object]] = []
    for n, k in [(50, 5), (70_000, 40), (300, 200)]:
        s = _stream(n, k, n)
        out.append((f"wire-{n}", wire.encode(s), lambda b: wire.decode(b)))
        bundle = wire.pack([(0, wire.encode(s)), (1, wire.encode(_stream(n, 3, 1)))])
        out.append(
            (f"bundle-{n}", bundle, lambda b: [wire.decode(x) for _, x in wire.unpack(b, 2)])
        )
        for qname in ["natural", "qsgd", "dithering", "natural_dithering"]:
            q = compress.get(qname)
            for coding in ["fixed", "delta", "elias-fano"]:
                msg = encode_quantized_stream(s, q, index_coding=coding)
                out.append(
                    (
                        f"{qname}-{coding}-{n}",
                        msg,
                        lambda b, q=q: decode_quantized_stream(
                            b, q, torch.float32, torch.device("cpu")
                        ),
                    )
                )
    codec = StreamCodec(compress.get("natural"), "all")
    s = _stream(1000, 30, 7)
    out.append(
        (
            "codec",
            codec.encode(s),
            lambda b: codec.decode(b, 1000, torch.float32, torch.device("cpu")),
        )
    )
    asq = ASQ(k=10)
    payload, ctx = asq.compress(torch.randn(500))
    out.append(("asq", payload, lambda b: asq.decompress(b, ctx)))
    sel = compress.get("topk", k=20)
    payload, _ = sel.compress(torch.randn(400))
    ctx400 = Context((400,), torch.float32, torch.device("cpu"))
    out.append(("topk-payload", payload, lambda b: sel.decompress(b, ctx400)))
    return out


def _mutate(buf: bytes, rng: random.Random) -> bytes:
    b = bytearray(buf)
    kind = rng.randrange(7)
    if kind == 0 and b:  # flip a few bytes anywhere
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:  # truncate
        b = b[: rng.randrange(len(b) + 1)]
    elif kind == 2:  # trailing bytes
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
    elif kind == 3 and len(b) >= 16:  # a 64-bit header field set to an edge value
        off = rng.choice([8, 16, 24]) if len(b) >= 32 else 8
        val = rng.choice([0, 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, len(b)])
        b[off : off + 8] = struct.pack("<Q", val)
    elif kind == 4 and len(b) >= 8:  # flags / codes / reserved bytes
        b[rng.randrange(3, 8)] = rng.randrange(256)
    elif kind == 5 and len(b) > 40:  # scramble a run of (index) bytes
        lo = rng.randrange(16, len(b) - 8)
        run = b[lo : lo + 8]
        rng.shuffle(run)
        b[lo : lo + 8] = run if rng.random() < 0.5 else b[lo - 8 : lo]
    else:  # all-0xFF run: huge varints, negative 8-byte indices
        lo = rng.randrange(len(b) + 1)
        b[lo : lo + 9] = b"\xff" * 9
    return bytes(b)


def _well_formed(result: object) -> None:
    streams = result if isinstance(result, list) else [result]
    for s in streams:
        if isinstance(s, SparseStream) and not s.is_dense:
            idx = s.indices
            assert idx.numel() == s.values.numel()
            if idx.numel():
                assert int(idx[0]) >= 0 and int(idx[-1]) < s.size
                assert bool((idx[1:] > idx[:-1]).all())


def test_mutated_inputs_only_wireformaterror() -> None:
    rng = random.Random(2026)
    decoders = _decoders()
    for _, msg, fn in decoders:  # the valid messages decode
        _well_formed(fn(msg))  # type: ignore[operator]
    accepted = rejected = 0
    for i in range(INPUTS):
        name, msg, fn = decoders[i % len(decoders)]
        data = _mutate(bytes(msg.tolist()), rng)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        try:
            _well_formed(fn(buf))  # type: ignore[operator]
            accepted += 1
        except WireFormatError:
            rejected += 1
        except Exception as e:  # pragma: no cover - the failure this test exists for
            raise AssertionError(f"{name}: {type(e).__name__}: {e} on input {data.hex()}") from e
    assert rejected > INPUTS // 4 and accepted + rejected == INPUTS
