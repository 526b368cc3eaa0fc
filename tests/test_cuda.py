"""Every CUDA path once: streams, wire format, collectives, compressors, error feedback,
the DDP hook and FSDP2's reduce-scatter, with CUDA tensors (skipped without a GPU).

* in-process ranks sharing the GPU (the local communicator stages payloads through
  host memory, as gloo does) and spawned gloo processes with CUDA tensors: results
  come back on the GPU and equal the CPU results bit for bit where the computation
  is exact (stream sums, every exact collective, top-k selection);
* NCCL at world size 1 (one GPU holds one NCCL rank): the collectives, the DDP
  hook and FSDP2's reduce-scatter through the NCCL communicator;
* where CPU and GPU round differently (random draws, matrix products, sums of
  floats in another order) the test states its tolerance.

``benchmarks/gpu_check.sh OUT`` runs this file and the GPU kernel benchmark on a GPU
machine. ``SPARCML_TEST_DEVICE=cpu pytest tests/test_cuda.py`` runs the same tests
on the CPU (every comparison then compares the CPU with itself): it checks the
tests on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import cuda_workers
from inputs import dense_reference, make_stream
from sparcml import (
    ErrorFeedback,
    OkTopkState,
    SparseStream,
    algorithms,
    compress,
    oktopk_allreduce,
    sparse_allreduce,
)
from sparcml.comm import run_ranks
from sparcml.comm.launch import run_processes
from sparcml.torch import topk_sgd_step
from sparcml.wire import decode, decode_concat, encode

DEVICE = os.environ.get("SPARCML_TEST_DEVICE", "cuda")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"  # the one-rank process group
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
STEPS = 6


def _on_device(s: SparseStream) -> None:
    assert s.device.type == torch.device(DEVICE).type
    assert s.values.device.type == s.device.type
    if not s.is_dense:
        assert s.indices.device.type == s.device.type


# --- streams and the wire format --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["random", "overlap", "disjoint", "skewed", "empty", "dense"])
def test_stream_ops_match_cpu(dtype: torch.dtype, pattern: str) -> None:
    cpu = [make_stream(pattern, r, 4, 1000, dtype, integer=False) for r in range(4)]
    dev = [s.to(DEVICE) for s in cpu]
    total = SparseStream.sum(dev)
    _on_device(total)
    assert total.to("cpu").equal(SparseStream.sum(cpu))
    two = dev[0] + dev[1]
    _on_device(two)
    assert two.to("cpu").equal(cpu[0] + cpu[1])
    assert torch.equal(total.to_dense().cpu(), SparseStream.sum(cpu).to_dense())
    parts = total.split([0, 1, 300, 999, 1000])
    for p, q in zip(parts, SparseStream.sum(cpu).split([0, 1, 300, 999, 1000]), strict=True):
        _on_device(p)
        assert p.to("cpu").equal(q)
    joined = SparseStream.concat(parts)  # a one-entry piece may come back dense
    assert torch.equal(joined.to_dense().cpu(), SparseStream.sum(cpu).to_dense())
    acc = dev[0].clone()
    acc.add_(dev[1])
    assert acc.to("cpu").equal(cpu[0] + cpu[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [0, 1, 200, 70_001, 20_000_000])  # 1-, 2-, 3- and 4-byte indices
def test_wire_round_trip_matches_cpu_bytes(dtype: torch.dtype, size: int) -> None:
    nnz = min(size, 5000)
    g = torch.Generator().manual_seed(size)
    idx = torch.randperm(size, generator=g)[:nnz].sort().values
    cpu = SparseStream(idx, torch.randn(nnz, generator=g).to(dtype), size)
    dev = cpu.to(DEVICE)
    for coding in (True, False):  # Elias-Fano indices where smaller; the fixed fields
        buf = encode(dev, elias_fano=coding)
        assert buf.device.type == torch.device(DEVICE).type
        assert torch.equal(buf.cpu(), encode(cpu, elias_fano=coding))  # the same bytes
        assert decode(buf).to("cpu").equal(cpu)
    back = decode(buf)
    _on_device(back)
    assert back.to("cpu").equal(cpu)
    joined = decode_concat([buf, buf], [size, size], dtype)
    if cpu.is_dense:  # decode_concat hands a dense message back to decode
        assert joined is None
    else:
        _on_device(joined)
        assert joined.to("cpu").equal(SparseStream.concat([cpu, cpu]))


def test_strided_and_one_element_inputs() -> None:
    base = torch.randn(4000, device=DEVICE)
    strided = base[::4]  # a view with stride 4
    s = SparseStream.from_dense(strided)
    _on_device(s)
    assert torch.equal(s.to_dense(), strided)
    one = SparseStream(torch.tensor([0], device=DEVICE), torch.tensor([2.5], device=DEVICE), 1)
    out = run_ranks(3, lambda comm: sparse_allreduce(one, comm))
    assert all(o.to_dense().tolist() == [7.5] for o in out)


# --- collectives on in-process ranks ----------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA synchronisations")
@pytest.mark.parametrize("algorithm", ["ssar_recursive_double", "ssar_split_allgather"])
def test_a_gpu_stream_on_a_host_transport_costs_one_copy_each_way(algorithm: str) -> None:
    """In-process ranks move bytes through host memory: the call runs on a host copy
    (``staged_on_host``), so each rank synchronises with its GPU for the copies of
    the stream's indices and values to the host and of the result's back: 4 each. On
    the GPU, the encoding, the checks and the merges cost about 10 a rank."""
    import warnings

    def fn(comm, device):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, comm.world_size, 100_003).to(device)
        return sparse_allreduce(s, comm, algorithm=algorithm)

    cpu = run_ranks(2, fn, "cpu")
    run_ranks(2, fn, DEVICE)  # warm: kernels, caches
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            dev = run_ranks(2, fn, DEVICE)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "called a synchronizing CUDA operation" in str(w.message)]
    assert 2 * 2 <= len(syncs) <= 2 * 4, [str(w.message)[:80] for w in syncs]
    for c, d in zip(cpu, dev, strict=True):
        _on_device(d)
        assert d.to("cpu").equal(c)


@pytest.fixture(params=["host copy", "on the device"])
def collective_path(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Both paths of a GPU stream on a host transport: the host copy
    (``staged_on_host``, the default) and the GPU path NCCL's communicator takes,
    forced here on in-process ranks."""
    if request.param == "on the device":
        import sparcml.collectives.allreduce as allreduce

        monkeypatch.setattr(allreduce, "staged_on_host", lambda stream, comm: stream)
    return request.param


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("algorithm", [*algorithms(exact=True, variants=False), "auto"])
def test_exact_collectives_match_cpu(world: int, algorithm: str, collective_path: str) -> None:
    def fn(comm, device, pattern, dtype):  # type: ignore[no-untyped-def]
        s = make_stream(pattern, comm.rank, comm.world_size, 997, dtype).to(device)
        return sparse_allreduce(s, comm, algorithm=algorithm)

    for pattern, dtype in [
        ("random", torch.float32),
        ("overlap", torch.float16),
        ("dense", torch.float64),
    ]:
        cpu = run_ranks(world, fn, "cpu", pattern, dtype)
        dev = run_ranks(world, fn, DEVICE, pattern, dtype)
        for c, d in zip(cpu, dev, strict=True):
            _on_device(d)
            assert d.to("cpu").equal(c), (pattern, dtype)


@pytest.mark.parametrize("algorithm", ["twolevel_shard", "twolevel_leader", "reduce_scatter"])
def test_two_level_on_device_match_cpu(algorithm: str, collective_path: str) -> None:
    """On 2 nodes x 2 ranks: the two-level allreduces and the two-level
    reduce-scatter (FSDP2's) on device tensors equal the CPU's bit for bit."""
    from sparcml.collectives import reduce_scatter
    from sparcml.comm import Topology

    def fn(comm, device, pattern, dtype):  # type: ignore[no-untyped-def]
        comm.set_topology(Topology.regular(4, 2))
        s = make_stream(pattern, comm.rank, comm.world_size, 997, dtype).to(device)
        if algorithm == "reduce_scatter":
            return reduce_scatter(s, comm)
        return sparse_allreduce(s, comm, algorithm=algorithm)

    for pattern, dtype in [("random", torch.float32), ("dense", torch.float64)]:
        cpu = run_ranks(4, fn, "cpu", pattern, dtype)
        dev = run_ranks(4, fn, DEVICE, pattern, dtype)
        for c, d in zip(cpu, dev, strict=True):
            _on_device(d)
            assert d.to("cpu").equal(c), (pattern, dtype)


@pytest.mark.parametrize("world", [1, 3])
def test_topk_family_collectives_on_device(world: int, collective_path: str) -> None:
    def fn(comm, device):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(1000 + comm.rank)
        acc = torch.randn(3000, generator=g).to(device)
        top = torch.topk(acc.abs(), 40).indices.sort().values
        local = SparseStream(top, acc[top], acc.numel())
        return {
            "gtopk": sparse_allreduce(local, comm, algorithm="gtopk"),
            "topka": sparse_allreduce(local, comm, algorithm="topka"),
            "gaussiank": sparse_allreduce(
                SparseStream.dense(acc), comm, algorithm="gaussiank", k=40
            ),
            "oktopk": oktopk_allreduce(acc, 40, comm, OkTopkState(tau=1, tau_prime=1)).stream,
        }

    cpu = run_ranks(world, fn, "cpu")
    dev = run_ranks(world, fn, DEVICE)
    for key in cpu[0]:
        for r in range(world):
            _on_device(dev[r][key])
            assert dev[r][key].equal(dev[0][key]), (key, r)  # identical on every rank
        got, want = dev[0][key].to("cpu"), cpu[0][key]
        # the same selections; the sums' order (and Gaussiank's mean and deviation)
        # may round differently on the GPU
        assert torch.equal(got.indices, want.indices), key
        assert torch.allclose(got.values, want.values, rtol=1e-6, atol=1e-6), key


@pytest.mark.parametrize(
    ("quantizer", "params"), [("qsgd", {"bits": 8, "bucket": 256}), ("natural", {})]
)
@pytest.mark.parametrize("quantize", ["dense", "contributions", "all"])
def test_quantized_allreduce_on_device_is_identical_and_close(
    quantizer: str,
    params: dict,
    quantize: str,  # type: ignore[type-arg]
    collective_path: str,
) -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("overlap", comm.rank, 4, 3001, integer=False).to(DEVICE)
        q = compress.get(quantizer, seed=comm.rank, **params)
        return s, sparse_allreduce(s, comm, quantizer=q, quantize=quantize)

    out = run_ranks(4, fn)
    ref = dense_reference([o[0].to("cpu") for o in out])
    for _, res in out:
        _on_device(res)
        assert res.equal(out[0][1])
    err = out[0][1].to("cpu").to_dense().double() - ref
    # 8-bit QSGD: the CPU test's bound (test_feedback, ~13% per quantization);
    # natural compression: variance 1/8 per quantization (~35% relative l2 error),
    # stacked along the phases under "all". A wrong sum is off by ~100%
    bound = 0.25 if quantizer == "qsgd" else 0.75
    assert float(err.norm() / ref.norm()) <= bound


# --- compressors and error feedback -----------------------------------------------

SELECTORS = [
    ("topk", {"density": 0.01}),
    ("trimmed_topk", {"k": 50}),
    ("threshold_bsearch", {"k": 50}),
    ("sampled_threshold_bsearch", {"k": 50}),
    ("threshold_reuse", {"k": 50}),
    ("gaussiank", {"k": 50}),
    ("blocktopk", {}),
    ("randomk", {"k": 50}),
]
QUANTIZERS = [
    ("qsgd", {}),
    ("qsgd", {"bits": 2, "bucket": 128}),
    ("natural", {}),
    ("natural", {"format": 8}),
    ("natural", {"deterministic": True}),
    ("dithering", {}),
    ("natural_dithering", {"compress_norm": True}),
]


def test_every_registered_operator_is_covered() -> None:
    names = {n for n, _ in SELECTORS + QUANTIZERS} | {"asq"}
    assert names == set(compress.available())


@pytest.mark.parametrize(("name", "params"), SELECTORS)
def test_selectors_on_device(name: str, params: dict) -> None:  # type: ignore[type-arg]
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    op_cpu, op_dev = compress.get(name, **params), compress.get(name, **params)
    for _ in range(3):  # threshold_reuse reuses its threshold from the second call
        want = op_cpu.select(x)
        got = op_dev.select(x.to(DEVICE))
    _on_device(got)
    assert got.nnz > 0
    assert torch.equal(got.values.cpu(), x[got.indices.cpu()])  # selected entries are x's own
    if name != "randomk":  # random draws differ between the CPU's and the GPU's generator
        # Gaussiank's fitted mean and deviation may round differently on the GPU
        if name == "gaussiank":
            assert abs(got.nnz - want.nnz) <= 2
        else:
            assert got.to("cpu").equal(want)
    payload, ctx = op_dev.compress(x.to(DEVICE))
    y = op_dev.decompress(payload, ctx)
    assert y.device.type == torch.device(DEVICE).type and y.shape == x.shape


@pytest.mark.parametrize(("name", "params"), QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantizers_on_device(name: str, params: dict, dtype: torch.dtype) -> None:  # type: ignore[type-arg]
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    op = compress.get(name, seed=1, **params)
    payload, ctx = op.compress(x)
    assert payload.device.type == torch.device(DEVICE).type
    y = op.decompress(payload, ctx)
    assert y.device.type == x.device.type and y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())
    # unbiased: the mean of 200 independent quantizations approaches x (a quantizer
    # that drops or rescales its input is off by ~100%); deterministic rounding (natural,
    # deterministic=True) is within a factor 2 of each entry instead
    if params.get("deterministic"):
        ratio = (y.float() / x.float())[x != 0]
        assert bool(((ratio >= 0.5) & (ratio <= 2.0)).all())
        return
    mean = torch.stack([op.decompress(*op.compress(x)).float() for _ in range(200)]).mean(0)
    rel = float((mean - x.float()).norm() / x.float().norm())
    assert rel <= 0.25, rel  # one quantization's error (<= ~1) shrinks as 1/sqrt(200)


def test_asq_and_compositions_on_device() -> None:
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for name, params in [("asq", {"k": 50}), ("topk+natural", {"k": 50}), ("topk+qsgd", {"k": 50})]:
        op = compress.get(name, **params)
        payload, ctx = op.compress(x)
        y = op.decompress(payload, ctx)
        assert y.device.type == x.device.type and y.shape == x.shape, name
        assert 0 < int((y != 0).sum()) <= 2 * 50, name


@pytest.mark.parametrize(
    ("name", "params"), [("topk", {"k": 30}), ("natural", {}), ("topk+natural", {"k": 30})]
)
def test_error_feedback_on_device(name: str, params: dict) -> None:  # type: ignore[type-arg]
    ef = ErrorFeedback()
    op = compress.get(name, **params)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        grad = torch.randn(40, 25, generator=g).to(DEVICE).t()  # non-contiguous
        acc = ef.compensate(grad, "w", lr=0.1)
        sent = op.decompress(*op.compress(acc))
        ef.update(acc, sent, "w")
        r = ef.residual("w")
        assert r is not None and r.device.type == torch.device(DEVICE).type
        assert torch.allclose(sent + r, acc, rtol=0, atol=1e-6 * float(acc.abs().max()))


@pytest.mark.parametrize("world", [1, 3])
def test_topk_sgd_step_on_device_matches_cpu(world: int) -> None:
    def fn(comm, device):  # type: ignore[no-untyped-def]
        ef = ErrorFeedback()
        g = torch.Generator().manual_seed(comm.rank)
        return [
            topk_sgd_step(torch.randn(500, generator=g).to(device), "w", ef, comm, k=15, lr=0.5)
            for _ in range(3)
        ]

    cpu, dev = run_ranks(world, fn, "cpu"), run_ranks(world, fn, DEVICE)
    for c, d in zip(cpu, dev, strict=True):
        for a, b in zip(c, d, strict=True):
            assert b.device.type == torch.device(DEVICE).type
            assert torch.equal(b.cpu(), a)


# --- spawned processes: gloo with CUDA tensors, NCCL at world size 1 ----------------

pytest_spawn = pytest.mark.spawn


@pytest_spawn
def test_every_algorithm_over_gloo_with_device_tensors() -> None:
    out = run_processes(2, cuda_workers.every_algorithm, DEVICE, timeout=120)
    for i in range(len(out[0])):
        size, pattern, algo = out[0][i][:3]
        ref = dense_reference([decode(o[i][3]) for o in out])
        for o in out:
            assert torch.equal(o[i][4], out[0][i][4]), (size, pattern, algo)
            assert torch.device(o[i][5]).type == torch.device(DEVICE).type
        got = decode(out[0][i][4]).to_dense().to(torch.float64)
        assert torch.equal(got, ref), (size, pattern, algo)


@pytest_spawn
def test_topk_family_over_gloo_with_device_tensors() -> None:
    out = run_processes(3, cuda_workers.topk_family, DEVICE, timeout=120)
    for key in ("oktopk", "gtopk", "topka", "gaussiank"):
        assert all(o[key].equal(out[0][key]) for o in out), key
        assert all(torch.device(o["devices"][key]).type == torch.device(DEVICE).type for o in out)
    # the same results as on the CPU's in-process ranks
    cpu = run_ranks(3, cuda_workers.topk_family, "cpu")
    for key in ("oktopk", "gtopk", "topka", "gaussiank"):
        assert torch.equal(out[0][key].indices, cpu[0][key].indices), key
        assert torch.allclose(out[0][key].values, cpu[0][key].values, rtol=1e-6, atol=1e-6), key


@pytest_spawn
def test_collectives_over_one_rank_process_group() -> None:
    (out,) = run_processes(1, cuda_workers.every_algorithm, DEVICE, timeout=120, backend=BACKEND)
    for size, pattern, algo, inp, res, device in out:
        assert torch.device(device).type == torch.device(DEVICE).type
        # the sum of one rank is its input (the dense algorithm answers densely)
        assert torch.equal(decode(res).to_dense(), decode(inp).to_dense()), (size, pattern, algo)


def _check_ddp(out: list[dict]) -> None:  # type: ignore[type-arg]
    plain = out[0]["plain"]["params"]
    for label in out[0]:
        for o in out:
            assert torch.device(o[label]["device"]).type == torch.device(DEVICE).type
            assert torch.equal(o[label]["params"], out[0][label]["params"]), label
        p = out[0][label]["params"]
        assert bool(torch.isfinite(p).all()), label
        if label.split(" ")[0] in {m for m, _ in cuda_workers.DDP_LOSSLESS} and "0.05" not in label:
            assert torch.allclose(p, plain, rtol=1e-5, atol=1e-5), label
        else:
            # a lossy method moves the parameters by about what plain DDP moved them
            init = cuda_workers.flat_params(cuda_workers.make_model())
            moved, plain_moved = float((p - init).norm()), float((plain - init).norm())
            assert 0.2 * plain_moved <= moved <= 3 * plain_moved, (label, moved, plain_moved)


@pytest_spawn
def test_ddp_hook_over_gloo_with_a_model_on_the_device() -> None:
    _check_ddp(run_processes(2, cuda_workers.ddp_methods, DEVICE, STEPS, timeout=180))


@pytest_spawn
def test_ddp_hook_over_one_rank_process_group() -> None:
    _check_ddp(
        run_processes(1, cuda_workers.ddp_methods, DEVICE, STEPS, timeout=180, backend=BACKEND)
    )


@pytest_spawn
def test_fsdp2_reduce_scatter_over_one_rank_process_group() -> None:
    (out,) = run_processes(
        1, cuda_workers.fsdp_methods, DEVICE, STEPS, timeout=180, backend=BACKEND
    )
    plain = out["plain"]["params"]
    init = cuda_workers.flat_params(cuda_workers.make_model())
    for label, o in out.items():
        assert torch.device(o["device"]).type == torch.device(DEVICE).type, label
        assert bool(torch.isfinite(o["params"]).all()), label
    assert torch.allclose(out["topk 1.0"]["params"], plain, rtol=1e-5, atol=1e-5)
    for label in ("topk 0.05", "natural"):
        moved = float((out[label]["params"] - init).norm())
        assert 0.2 * float((plain - init).norm()) <= moved, label


@pytest_spawn
def test_the_training_harness_on_the_device(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``sparcml train --device``: PyTorch's hooks and a sparcml method train a small
    word-level LSTM on two spawned gloo ranks with the model on the device."""
    import json

    from sparcml.tools.cli import main
    from test_recipes import _plays

    monkeypatch.setenv("SPARCML_DATA", str(tmp_path))
    _plays(tmp_path, " ".join(f"w{'q' * (i % 11)} a b" for i in range(6000)))
    out = tmp_path / "out"
    args = ["train", "wordlm", "-P", "2", "-q", "--device", DEVICE, "--probe-steps", "2",
            "--limit", "400", "--recipe-option", "vocab=20", "--recipe-option", "width=8",
            "--methods", "ddp,powersgd,topk", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    for method, run in rows.items():
        assert torch.device(run["device"]).type == torch.device(DEVICE).type, method
        assert len(run["losses"]) == 10, method  # 400 sequences / (2 ranks x 20)
        assert all(torch.isfinite(torch.tensor(run["losses"]))), method
        assert run["evals"][-1]["perplexity"] < 20, method  # a 20-word vocabulary
        assert run["compute_s"] > 0, method
    assert rows["topk"]["step_bytes"][-1] < rows["ddp"]["step_bytes"][-1]
