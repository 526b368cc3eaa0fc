"""Rank functions for DDP / sync_gradients training tests (module level: spawned and
mpirun processes import them). The same small training runs under every transport."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import sparcml.torch as st
from sparcml.torch.hook import sparcml_hook


def make_model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(32, 20, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return x, y


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_train(
    comm: Any,
    method: str | None,
    hyper: dict[str, Any],
    steps: int,
    record: bool,
    user_collectives: bool = False,
) -> dict[str, Any]:
    """Train with DDP; ``method=None`` is plain DDP (PyTorch's own allreduce)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), bucket_cap_mb=0.004)  # several buckets of ~1000 entries
    state = None
    records: list[tuple[int, tuple[str, ...], torch.Tensor, torch.Tensor]] = []
    if method is not None and not record:
        state = st.register(model, method, **hyper)
    elif method is not None:
        # the same hook, wrapped to record each bucket's input and output
        state = st.SparcmlState(method, **hyper)
        state.param_names = {id(p): n for n, p in model.module.named_parameters()}

        def hook(s, bucket):  # type: ignore[no-untyped-def]
            names = tuple(
                s.name_of(p, i, bucket.index()) for i, p in enumerate(bucket.parameters())
            )
            step, grad = s.step, bucket.buffer().clone()

            def keep(f):  # type: ignore[no-untyped-def]
                records.append((step, names, grad, f.value().clone()))
                return f.value()

            return sparcml_hook(s, bucket).then(keep)

        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for t in range(steps):
        x, y = batch(comm.rank, t)
        h = model(x)
        if user_collectives:
            # the user's own collective on the default group, issued during backward
            # while sparcml's engine reduces earlier buckets on its own group
            h.register_hook(lambda g: (dist.all_reduce(torch.ones(1)), g)[1])
        loss = torch.nn.functional.cross_entropy(h, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {
        "params": flat_params(model.module),
        "losses": losses,
        "records": records,
        "step_bytes": list(state.step_bytes) if state is not None else [],
    }


def _train_steps(model: torch.nn.Module, rank: int, steps: int) -> None:
    """``steps`` of SGD (lr 0.1) on this rank's batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(steps):
        x, y = batch(rank, t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def ddp_comm_hook_train(
    comm: Any, method: str, hyper: dict[str, Any], steps: int
) -> dict[str, Any]:
    """DDP with sparcml.torch.comm_hook's (state, hook) pair through PyTorch's own
    register_comm_hook (the state built at the first bucket)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), bucket_cap_mb=0.004)
    state, hook = st.comm_hook(method, **hyper)
    model.register_comm_hook(state, hook)
    _train_steps(model, comm.rank, steps)
    return {"params": flat_params(model.module), "step_bytes": list(state.state.step_bytes)}


def comm_hook_checkpoint_into(comm: Any, other: bool) -> dict[str, Any]:
    """A checkpoint of a comm_hook state after one step, loaded into a fresh pair on
    the same model (``other=False``) or on another one of the same parameter count
    (``other=True``: the two layers swapped), then one step: what it raised."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build(swap: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        model = DDP(torch.nn.Sequential(b, a) if swap else torch.nn.Sequential(a, b))
        state, hook = st.comm_hook("topk", density=0.1)
        model.register_comm_hook(state, hook)
        return model, state

    def step(model: Any, inputs: int) -> None:
        g = torch.Generator().manual_seed(comm.rank)
        model(torch.randn(4, inputs, generator=g)).square().sum().backward()

    model, state = build(False)
    step(model, 8)
    saved = state.state_dict()
    model, state = build(other)
    state.load_state_dict(saved)
    try:
        step(model, 16 if other else 8)
    except ValueError as e:
        return {"raised": str(e), "parameters": saved["parameters"]}
    return {"raised": None, "parameters": saved["parameters"]}


def ddp_16bit_train(comm: Any, which: str, steps: int) -> torch.Tensor:
    """DDP with PyTorch's fp16/bf16 compress hook (``torch_fp16``, ``torch_bf16``) or
    sparcml's ``fp16`` / ``bf16`` method; the parameters after ``steps``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), bucket_cap_mb=0.004)
    if which == "torch_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif which == "torch_bf16":
        # DDP refuses bf16_compress_hook by name off CUDA/NCCL; the same function
        # called from a wrapper runs on gloo as is
        def bf16_hook(state, bucket):  # type: ignore[no-untyped-def]
            return default_hooks.bf16_compress_hook(state, bucket)

        model.register_comm_hook(None, bf16_hook)
    else:
        st.register(model, which)
    _train_steps(model, comm.rank, steps)
    return flat_params(model.module)


def ddp_stats_logged(comm: Any, ranks: str, steps: int, fsdp: bool = False) -> list[str]:
    """DDP with the hook (or FSDP2's reduce-scatter) and stats_every=2: the lines the
    "sparcml" logger emitted."""
    import logging

    from torch.nn.parallel import DistributedDataParallel as DDP

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("sparcml")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        st.register_fsdp(model, "topk", density=0.1, stats_every=2, stats_ranks=ranks)
    else:
        model = DDP(make_model(), bucket_cap_mb=0.004)
        st.register(model, "topk", density=0.1, stats_every=2, stats_ranks=ranks)
    _train_steps(model, comm.rank, steps)
    return [ln for ln in lines if ln.startswith("sparcml step")]


def sync_train(comm: Any, method: str, hyper: dict[str, Any], steps: int) -> torch.Tensor:
    """Train without DDP through sync_gradients on ``comm`` (gloo, MPI or in-process)."""
    model = make_model()
    state = st.SparcmlState(method, comm=comm, **hyper)
    st.broadcast_parameters(model, state)
    opt = st.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, state)
    for t in range(steps):
        x, y = batch(comm.rank, t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat_params(model)


def sparse_lr_losses(comm: Any, method: str, steps: int) -> dict[str, Any]:
    """The newsgroups recipe's model (2^22 hashed features) on synthetic sparse bags."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparcml.tools.recipes.newsgroups import FEATURES, LogReg

    model = DDP(LogReg())
    state = st.register(model, method)
    opt = torch.optim.SGD(model.parameters(), lr=4.0)
    losses = []
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * comm.rank + t)
        ids = torch.randint(0, FEATURES, (8 * 50,), generator=g)
        weights = torch.rand(8 * 50, generator=g)
        offsets = torch.arange(0, 8 * 50, 50)
        y = torch.randint(0, 2, (8,), generator=g).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model((ids, weights, offsets)), y
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "bytes": sum(state.step_bytes), "w": model.module.w.weight.detach()}


def ddp_sparse_embedding(
    comm: Any, configs: list[tuple[str | None, dict[str, Any]]], steps: int, width: int = 8
) -> list[dict[str, Any]]:
    """An EmbeddingBag(sparse=True) model under DDP, once per (method, hyper) config
    (``None``: plain DDP, PyTorch's own sparse-gradient allreduce); ``width`` 1 is a
    linear model's (``newsgroups --recipe-option sparse=1``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = []
    for method, hyper in configs:
        g = torch.Generator().manual_seed(3)
        module = torch.nn.Sequential(
            torch.nn.EmbeddingBag(300, width, mode="sum", sparse=True), torch.nn.Linear(width, 3)
        )
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model = DDP(module)
        if method is not None:
            try:
                st.register(model, method, **hyper)
            except ValueError as e:
                out.append({"error": str(e)})
                continue
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses, sparse_grad = [], True
        for _ in range(steps):
            gen = torch.Generator().manual_seed(100 * comm.rank)  # one batch: the loss falls
            ids = torch.randint(0, 300, (16, 4), generator=gen)
            y = ids[:, 0] % 3
            loss = torch.nn.functional.cross_entropy(model(ids), y)
            opt.zero_grad()
            loss.backward()
            sparse_grad = sparse_grad and module[0].weight.grad.is_sparse
            opt.step()
            losses.append(float(loss.detach()))
        out.append({"params": flat_params(module), "losses": losses, "sparse_grad": sparse_grad})
    return out


def powersgd_runs(comm: Any, steps: int) -> dict[str, Any]:
    """PyTorch's baselines through ``register`` by name, and PowerSGD registered by hand
    with the settings ``register`` documents (one DDP bucket: PowerSGD's nested
    allreduces must not have two buckets in flight on gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for label in ("by name", "by hand", "ddp", "plain"):
        model = DDP(make_model(), bucket_cap_mb=25)
        state = None
        if label == "by name":
            state = st.register(model, "powersgd", warmup_steps=2)
            out["hook_state"] = type(state.hook_state).__name__
        elif label == "by hand":
            ps = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                use_error_feedback=True, warm_start=True, random_seed=0,
            )  # fmt: skip
            model.register_comm_hook(ps, psgd.powerSGD_hook)
        elif label == "ddp":
            state = st.register(model, "ddp")
        _train_steps(model, comm.rank, steps)
        out[label] = flat_params(model.module)
        if label == "by name":
            out["by name bytes"] = list(state.step_bytes)
    for method, options in (("ddp", {"density": 0.1}), ("powersgd", {"density": 0.1})):
        try:
            st.register(DDP(make_model()), method, **options)
        except ValueError as e:
            out[f"{method} refuses"] = str(e)
    return out


def momentum_sgd_runs(
    comm: Any, runs: list[tuple[str | None, dict[str, Any], float]], steps: int
) -> list[torch.Tensor]:
    """Parameters after ``steps`` DDP steps per run ``(method, hyper, optimizer
    momentum)``; ``method=None`` is plain DDP. SGD at rate 0.1 on every run."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = []
    for method, hyper, momentum in runs:
        model = DDP(make_model())
        if method is not None:
            st.register(model, method, **hyper)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        for step in range(steps):
            x, y = batch(comm.rank, step)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append(flat_params(model))
    return out


def ddp_error_between_buckets(comm: Any, slow_rank: int) -> list[tuple[int, str, int]]:
    """Steps under the DDP hook whose third has NaN gradients (``nan_policy="raise"``),
    ``slow_rank`` pausing in backward between two of its buckets: each step's outcome
    and the state's step counter afterwards."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets
    state = st.register(ddp, "topk", density=0.5, nan_policy="raise", timeout=20.0)
    out = []
    for step in range(4):
        ddp.zero_grad()
        x, _ = batch(comm.rank, step)
        pause = None
        if comm.rank == slow_rank:  # the engine stores this bucket's error meanwhile
            pause = model[1].register_full_backward_hook(lambda *a: time.sleep(0.5))
        y = ddp(x)
        if step == 2:
            y = y * float("nan")
        try:
            y.sum().backward()
            what = "ok"
        except Exception as e:
            what = type(e).__name__
        finally:
            if pause is not None:
                pause.remove()
        out.append((step, what, state.step))
    return out


def ddp_raw_hook_against_register(comm: Any, steps: int) -> tuple[float, int, int]:
    """``register_comm_hook(state, sparcml_hook)`` by hand against ``register()``:
    the largest difference of the trained parameters, and how many residuals each
    state keeps (one per parameter)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(raw: bool) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        ddp = DDP(model, bucket_cap_mb=0.0015)  # DDP rebuilds its buckets after step 0
        if raw:
            state = st.SparcmlState("topk", density=0.1)
            ddp.register_comm_hook(state, sparcml_hook)
        else:
            state = st.register(ddp, "topk", density=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for t in range(steps):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * comm.rank + t))
            opt.zero_grad()
            ddp(x).tanh().sum().backward()
            opt.step()
        return flat_params(model), len(state.residuals)

    (a, na), (b, nb) = train(False), train(True)
    return float((a - b).abs().max()), na, nb


def device_refused_on_rank_1(comm: Any) -> str:
    """``agreed_device`` where rank 1 cannot use the device: the error each rank raises."""
    import sparcml.tools.recipes.train as train

    if comm.rank == 1:

        def missing(name: str, rank: int) -> torch.device:
            raise ValueError(f"--device {name!r}: this machine's PyTorch sees no CUDA device")

        train.training_device = missing  # this rank's host has no GPU
    try:
        train.agreed_device(comm, "cpu")
    except ValueError as e:
        return str(e)
    return "no error"
