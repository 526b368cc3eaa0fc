"""CUDA tensors through streams, the wire format and the collectives (skipped without a GPU).

The in-process communicator moves payloads through host memory, exactly as the
gloo backend stages CUDA payloads; results must come back on the GPU, equal the
CPU results bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from inputs import make_stream
from sparcml import SparseStream, algorithms, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.wire import decode, encode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_stream_ops_on_cuda_match_cpu() -> None:
    a = make_stream("overlap", 0, 2, 1000, integer=False)
    b = make_stream("overlap", 1, 2, 1000, integer=False)
    ga, gb = a.to("cuda"), b.to("cuda")
    assert (ga + gb).device.type == "cuda"
    assert (ga + gb).equal((a + b).to("cuda"))
    assert decode(encode(ga)).equal(ga)
    assert decode(encode(ga)).device.type == "cuda"
    parts = ga.split([0, 300, 1000])
    assert SparseStream.concat(parts).equal(ga)


@pytest.mark.parametrize("algorithm", [*algorithms(exact=True), "auto"])
def test_collectives_on_cuda_streams(algorithm: str) -> None:
    def fn(comm, device):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, comm.world_size, 997).to(device)
        return sparse_allreduce(s, comm, algorithm=algorithm)

    cpu = run_ranks(3, fn, "cpu")
    gpu = run_ranks(3, fn, "cuda")
    for c, g in zip(cpu, gpu, strict=True):
        assert g.device.type == "cuda"
        assert g.to("cpu").equal(c)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("topk", {"density": 0.01}),
        ("trimmed_topk", {"k": 10}),
        ("threshold_bsearch", {"k": 10}),
        ("threshold_reuse", {"k": 10}),
        ("gaussiank", {"k": 10}),
        ("blocktopk", {}),
        ("randomk", {"k": 10}),
        ("qsgd", {}),
        ("natural", {}),
        ("natural", {"format": 8}),
        ("dithering", {}),
        ("natural_dithering", {"compress_norm": True}),
        ("asq", {"k": 10}),
        ("topk+natural", {"k": 10}),
    ],
)
def test_compressors_on_cuda(name: str, params: dict) -> None:  # type: ignore[type-arg]
    from sparcml import compress

    x = torch.randn(5000, device="cuda")
    op = compress.get(name, **params)
    payload, ctx = op.compress(x)
    y = op.decompress(payload, ctx)
    assert y.device.type == "cuda" and y.shape == x.shape and y.dtype == x.dtype
    assert payload.device.type == "cuda"
