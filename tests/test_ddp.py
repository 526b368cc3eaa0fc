"""The DDP communication hook over real gloo processes (spawned, loopback).

Lossless settings reproduce PyTorch's own DDP allreduce (tolerance 1e-6: the
summation order differs); lossy methods give bitwise identical parameters on
every rank, and the hook's per-bucket results equal a one-process reference of
the method (top-k with per-parameter error feedback) computed from the buckets
every rank recorded.
"""

from __future__ import annotations

import pytest
import torch

import train_workers
from sparcml.comm.launch import run_processes

pytestmark = pytest.mark.spawn
STEPS = 6


def _train(world: int, method: str | None, record: bool = False, user: bool = False, **hyper):  # type: ignore[no-untyped-def]
    return run_processes(
        world, train_workers.ddp_train, method, hyper, STEPS, record, user, timeout=60
    )


@pytest.mark.parametrize("world", [3])  # not a power of two (P = 2: the gloo and MPI tests)
def test_lossless_hooks_reproduce_plain_ddp(world: int) -> None:
    plain = _train(world, None)
    for method, hyper in [("dense", {}), ("topk", {"density": 1.0})]:
        out = _train(world, method, **hyper)
        for r in range(world):
            assert torch.allclose(out[r]["params"], plain[r]["params"], rtol=1e-5, atol=1e-6)
            assert torch.equal(out[r]["params"], out[0]["params"])


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    idx = x.abs().topk(k).indices
    out[idx] = x[idx]
    return out


def test_topk_hook_equals_one_process_reference_and_overlaps_user_collectives() -> None:
    world, density = 3, 0.05
    out = _train(world, "topk", record=True, user=True, density=density, algorithm="topka")
    for r in range(world):
        assert torch.equal(out[r]["params"], out[0]["params"])
    recs = [o["records"] for o in out]
    assert len(recs[0]) > STEPS  # several buckets per step (after the first)
    residual: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for i in range(len(recs[0])):
        step, names, _, got = recs[0][i]
        total = None
        for r in range(world):
            s2, n2, grad, got_r = recs[r][i]
            assert (s2, n2) == (step, names) and torch.equal(got_r, got)
            sizes = [grad.numel()] if len(names) == 1 else None
            res = residual[r]
            parts = [res.get(n) for n in names]
            if sizes is None:
                sizes = _sizes(names)
            acc = grad + torch.cat(
                [p if p is not None else torch.zeros(s) for p, s in zip(parts, sizes, strict=True)]
            )
            k = min(acc.numel(), max(1, round(density * acc.numel())))
            sel = _topk(acc, k)
            for n, part in zip(names, (acc - sel).split(sizes), strict=True):
                res[n] = part
            total = sel if total is None else total + sel
        assert torch.allclose(got, total / world, rtol=1e-6, atol=1e-7)


def _sizes(names: tuple[str, ...]) -> list[int]:
    shapes = {n: p.numel() for n, p in train_workers.make_model().named_parameters()}
    return [shapes[n] for n in names]


@pytest.mark.parametrize("method", ["oktopk", "redsync", "natural", "topk+qsgd"])
def test_lossy_methods_train_identically_on_every_rank(method: str) -> None:
    out = _train(3, method, density=0.05, **({"min_bytes": 512} if method == "redsync" else {}))
    for r in range(3):
        assert torch.equal(out[r]["params"], out[0]["params"])
    assert all(b > 0 for b in out[0]["step_bytes"])
    assert out[0]["losses"][-1] < out[0]["losses"][0]


def test_lossless_sparse_lr_matches_dense_ddp() -> None:
    """The sparse LR recipe's model: the gradient's own non-zeros through the sparse
    allreduce give the dense run's loss curve (same seed) to float tolerance."""
    dense = run_processes(3, train_workers.sparse_lr_losses, "dense", 5, timeout=60)
    sparse = run_processes(3, train_workers.sparse_lr_losses, "nonzeros", 5, timeout=60)
    for d, s in zip(dense, sparse, strict=True):
        assert torch.allclose(torch.tensor(d["losses"]), torch.tensor(s["losses"]), atol=1e-6)
        assert torch.allclose(d["w"], s["w"], atol=1e-6)
        assert torch.equal(s["w"], sparse[0]["w"])
    assert sparse[0]["bytes"] * 50 < dense[0]["bytes"]


def test_the_state_and_hook_pair_is_the_registered_hook() -> None:
    """sparcml.torch.comm_hook's (state, hook) through PyTorch's own
    register_comm_hook trains exactly as register() does (bitwise, every rank),
    and bad options fail at once, before any process group exists."""
    import sparcml.torch as st

    hyper = {"density": 0.05, "momentum": 0.9}
    pair = run_processes(2, train_workers.ddp_comm_hook_train, "topk", hyper, STEPS, timeout=60)
    ref = _train(2, "topk", **hyper)
    for r in range(2):
        assert torch.equal(pair[r]["params"], ref[r]["params"]), r
        assert pair[r]["step_bytes"] == ref[r]["step_bytes"]
    with pytest.raises(ValueError, match="unknown option"):
        st.comm_hook("topk", densty=0.01)


def test_a_comm_hook_checkpoint_of_another_model_is_refused() -> None:
    """An audit found comm_hook's checkpoints carrying no parameters ({}), so one of
    another model with as many entries loaded silently, its residuals applied to
    the wrong tensors. The hook now records the shapes it meets: the checkpoint
    names them, and a load into another model drops what it loaded before a bucket
    uses it and raises ValueError at the end of the first backward (register()
    refuses it at once, knowing the model)."""
    same = run_processes(2, train_workers.comm_hook_checkpoint_into, False, timeout=60)
    other = run_processes(2, train_workers.comm_hook_checkpoint_into, True, timeout=60)
    for r in range(2):
        assert same[r]["raised"] is None
        assert sorted(same[r]["parameters"]) == ["param0", "param1", "param2", "param3"]
        assert other[r]["raised"] is not None and "other parameters" in other[r]["raised"]
        assert "param0: (16, 8) in the checkpoint, (8, 16) here" in other[r]["raised"]


@pytest.mark.parametrize("bits", ["fp16", "bf16"])
def test_16bit_methods_are_pytorchs_16bit_hooks_bitwise(bits: str) -> None:
    """register(model, "fp16") / "bf16" trains exactly as PyTorch's
    fp16_compress_hook / bf16_compress_hook (P = 2, every rank, bitwise)."""
    ours = run_processes(2, train_workers.ddp_16bit_train, bits, STEPS, timeout=60)
    theirs = run_processes(2, train_workers.ddp_16bit_train, f"torch_{bits}", STEPS, timeout=60)
    for r in range(2):
        assert torch.equal(ours[r], theirs[r]), r
    plain = _train(2, None)
    assert not torch.equal(ours[0], plain[0]["params"])  # 16 bits: not the fp32 run


def test_stats_every_logs_under_the_ddp_hook_on_rank_0_by_default() -> None:
    """Issue 33: SparcmlState(stats_every=N) did nothing under the DDP hook; now a
    line per group every N steps, on rank 0 (every rank with stats_ranks="all")."""
    first = run_processes(2, train_workers.ddp_stats_logged, "first", 4, timeout=60)
    assert len(first[0]) == 2 and first[1] == []  # steps 2 and 4 (one group)
    every = run_processes(2, train_workers.ddp_stats_logged, "all", 4, timeout=60)
    assert len(every[0]) == len(every[1]) == 2
    # FSDP2's reduce-scatter too (one group), with its measured step split
    fsdp = run_processes(2, train_workers.ddp_stats_logged, "first", 4, True, timeout=60)
    assert len(fsdp[0]) == 2 and fsdp[1] == [], fsdp
    assert "selected" in fsdp[0][0] and "compress 0.00 ms" not in fsdp[0][0], fsdp[0][0]


def test_an_error_of_one_bucket_is_raised_at_the_end_of_backward_on_every_rank() -> None:
    """A bucket's error every rank raises (NaN under ``nan_policy="raise"``) is raised
    at the end of backward on every rank, the communicator still usable. The next
    bucket's hook used to raise it before its own collective when the engine had
    stored it already: on a rank that paused between buckets, inside DDP's reducer
    (its next forward then failed DDP's assertion), while the other rank waited for
    that bucket's collective until its timeout."""
    out = run_processes(2, train_workers.ddp_error_between_buckets, 0, timeout=60)
    want = [(0, "ok", 1), (1, "ok", 2), (2, "FloatingPointError", 3), (3, "ok", 4)]
    assert out == [want, want]


def test_sparcml_hook_registered_by_hand_keeps_each_parameters_residual() -> None:
    """``ddp.register_comm_hook(state, sparcml_hook)``, as its docstring allows, trains
    bitwise as ``register()``: residuals were kept by bucket position, and after DDP
    rebuilt its buckets a parameter's residual went to another (12 residuals for 8
    parameters, parameters 0.09 apart after 5 steps)."""
    for diff, named, raw in run_processes(2, train_workers.ddp_raw_hook_against_register, 5):
        assert diff == 0.0 and named == raw == 8
