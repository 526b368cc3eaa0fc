"""The training loop every recipe shares, and the driver behind ``sparcml train``.

Each method runs on ``P`` local gloo processes: the recipe's model wrapped in DDP,
the method registered as its communication hook (``dense`` too, so every
method's bytes are counted the same way), identical initialisation and data
shards for every method (same seed). Per step it records the loss, the bytes
this rank sent and the wall time; per epoch the test figures (rank 0).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...comm.launch import run_processes
from ..bench.harness import STEAL_FLAG, cpu_times, steal_share, write_json

__all__ = ["check_device", "run_recipe", "train_worker", "write_report"]

log = logging.getLogger("sparcml.train")

#: ``--fsdp`` with ``--device cuda`` (refused by the command line and by every rank)
FSDP_ON_CPU_ONLY = (
    "the harness runs FSDP2 on the CPU only: drop --device or --fsdp "
    "(sparcml.torch.register_fsdp itself takes CUDA models)"
)


class _Progress:
    """A one-line progress bar on stderr (rank 0 only), redrawn at most twice a second."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.start = time.monotonic()
        self.last = 0.0

    def update(self, done: int, extra: str = "") -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.5 and done < self.total):
            return
        self.last = now
        frac = done / max(1, self.total)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        eta = (now - self.start) / max(frac, 1e-9) * (1 - frac)
        sys.stderr.write(f"\r{self.label:<28} [{bar}] {done}/{self.total} {extra} eta {eta:5.0f}s ")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _barrier(comm: Any) -> None:
    comm.allreduce(torch.zeros(1))


def train_worker(
    comm: Any, recipe_name: str, method: str, hyper: dict[str, Any], epochs: int,
    seed: int, options: dict[str, Any], progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """One rank of one method's run (for :func:`sparcml.comm.launch.run_processes`, or
    one rank of a torchrun / ``sparcml cluster`` job).

    ``options`` go to the recipe (``limit``, ``fsdp``), except the harness's own:
    ``eval_every`` (also evaluate every so many steps, and before the first; the
    training clock stops meanwhile), ``probe_steps`` (after training, time that many
    forward + backward passes without communication: the compute part of a step),
    ``line_progress`` (progress as log lines, for jobs whose output is piped),
    ``density_warmup`` (DGC's density warm-up over that many epochs), ``target`` and
    ``stop_after`` (stop once that many evaluations in a row reached the test figure
    ``target``: the run has shown its time to it; the stop is decided on rank 0 and
    shared, so every rank leaves at the same step), ``device`` (``"cpu"``, the
    default, or ``"cuda"``: the model, its gradients and the method's codec on this
    rank's GPU, ``cuda:(LOCAL_RANK or rank) % GPUs``; the collectives still go over
    the job's gloo process group, which moves CUDA tensors through host memory;
    step times are taken after a device synchronisation).
    A method from :mod:`.peers` (``ddp``, ``fp16``, ``bf16``, ``powersgd[R]``) runs
    PyTorch's own hook instead of sparcml's.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ... import torch as st
    from ...torch.peers import is_peer, register_peer
    from . import RECIPES

    options = dict(options)
    eval_every = int(options.pop("eval_every", 0) or 0)
    probe_steps = int(options.pop("probe_steps", 0) or 0)
    line_progress = bool(options.pop("line_progress", False))
    density_warmup = int(options.pop("density_warmup", 0) or 0)
    stop_target = options.pop("target", None)
    stop_after = int(options.pop("stop_after", 0) or 0)
    device = agreed_device(comm, str(options.pop("device", None) or "cpu"))
    recipe = RECIPES[recipe_name](comm.rank, comm.world_size, seed, **options)
    recipe.device = device
    if stop_after and not eval_every:
        raise ValueError("stop_after needs evaluations during training (eval_every)")
    if stop_target is None:
        stop_after = 0  # (the baseline that sets the target runs its whole schedule)
    if recipe.steps_per_epoch() < 1:
        raise ValueError(
            f"{recipe_name}: {options.get('limit') or 'all'} training samples give no "
            f"training step at {comm.world_size} ranks x batch {getattr(recipe, 'batch', '?')}; "
            f"use --limit >= {comm.world_size * getattr(recipe, 'batch', 1)} (it counts samples)"
        )
    fsdp = bool(options.get("fsdp"))
    if fsdp and device.type != "cpu":
        raise ValueError(FSDP_ON_CPU_ONLY)
    ddp_devices = [device] if device.type == "cuda" else None
    if density_warmup and not is_peer(method) and "config" not in hyper and "density" in hyper:
        # DGC's warm-up: 25% falling to the density
        hyper = {
            **hyper,
            "density": st.DensityWarmup(
                recipe.steps_per_epoch(), density_warmup, 0.25, hyper["density"]
            ),
        }
    peer = is_peer(method)
    # sparcml train --config FILE: the file holds the method and its options
    hyper = dict(hyper)
    registered: Any = hyper.pop("config", method)
    if fsdp:
        if peer:
            raise ValueError(f"{method!r} is a DDP communication hook; no FSDP version")
        # FSDP2: every module with parameters of its own sharded, then the root; the
        # method is the reduce-scatter (sparcml.torch.register_fsdp)
        from torch.distributed.fsdp import fully_shard

        model = recipe.model()
        for sub in model.modules():
            if sub is not model and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub)
        fully_shard(model)
        state = st.register_fsdp(model, registered, **hyper)
        inner = model
    elif peer:
        # PowerSGD's callbacks wait on nested allreduces inside gloo's worker threads: two
        # buckets in flight deadlock the process group (seen on the Shakespeare LSTM, whose
        # 1.4 MB gradient DDP splits at its 1 MB first bucket). An explicit bucket_cap_mb
        # also sets DDP's first bucket to 25 MB: one bucket for the models here.
        psgd = method.startswith("powersgd")
        net = recipe.model().to(device)
        model = DDP(net, ddp_devices, bucket_cap_mb=25) if psgd else DDP(net, ddp_devices)
        state = register_peer(model, method, start_iter=int(hyper.get("start_iter", 0)))
        inner = model.module
    else:
        model = DDP(recipe.model().to(device), ddp_devices)
        state = st.register(model, registered, **hyper)
        inner = model.module
    # DGC momentum correction moves the momentum from the optimizer into the state
    opt = recipe.optimizer(model.parameters(), momentum=peer or not state.settings.momentum)
    steps = recipe.steps_per_epoch()
    total = epochs * steps
    if eval_every < 0:
        eval_every = max(1, total // 15)
    show = progress and comm.rank == 0
    bar = _Progress(total, f"{recipe_name} {method}", show and not line_progress)
    losses: list[float] = []
    step_times: list[float] = []
    opt_times: list[float] = []
    # messages sent after the dense warm-up steps (which send none of their own), so
    # that messages per step cover the same steps as the bytes and times of the report
    warm_steps = int(getattr(getattr(state, "settings", None), "warmup_steps", 0) or 0)

    def messages_sent() -> int:
        stats = getattr(getattr(state, "comm", None), "stats", None)
        return int(stats.messages_sent) if stats is not None else 0

    warm_messages = messages_sent()
    # the hook's own clock (sparcml methods): local compression work and the
    # collective's time per step, summed over buckets and parameter groups
    compress_times: list[float] = []
    comm_times: list[float] = []
    hook_clock = _hook_clock(state)
    last_split = hook_clock()
    evals: list[dict[str, float]] = []
    clock = 0.0  # training time: the loop's wall time with evaluations taken out
    held = 0  # evaluations in a row at the target

    def at_target() -> bool:
        """Whether the last ``stop_after`` evaluations reached ``target`` (rank 0's
        figures, shared with every rank)."""
        nonlocal held
        reached = 0.0
        if comm.rank == 0:
            value = float(evals[-1][recipe.metric])
            ok = value >= stop_target if recipe.higher_is_better else value <= stop_target
            held = held + 1 if ok else 0
            reached = float(held >= stop_after)
        return bool(comm.allreduce(torch.tensor([reached], dtype=torch.float64))[0] > 0)

    def evaluate(epoch: float, step: int) -> None:
        model.eval()
        part = None if fsdp else recipe.evaluate_part(inner, comm.rank, comm.world_size)
        if part is not None:  # every rank evaluates its slice of the test set
            keys = sorted(part)
            summed = comm.allreduce(torch.tensor([part[k] for k in keys], dtype=torch.float64))
            figures = recipe.finish_evaluation(dict(zip(keys, summed.tolist(), strict=True)))
        else:
            # (FSDP's forward is a collective: every rank evaluates, rank 0's figures kept)
            figures = recipe.evaluate(inner) if comm.rank == 0 or fsdp else {}
        if comm.rank != 0:
            figures = {}
        figures.update(epoch=epoch, step=step, train_s=clock)
        evals.append(figures)
        _barrier(comm)  # every rank starts the next step together
        model.train()
        if show and line_progress and step:
            metric = f"{recipe.metric} {figures[recipe.metric]:.4f}"
            log.info("%s %s: step %d/%d, %.1f s of training, %s", recipe_name, method,
                     step, total, clock, metric)  # fmt: skip

    if eval_every:
        evaluate(0.0, 0)
    done = 0
    stopped = False
    next_line = time.monotonic() + 15
    for epoch in range(epochs):
        if stopped:
            break
        model.train()
        resumed = time.perf_counter()
        for batch in recipe.batches(epoch):
            t0 = time.perf_counter()
            inputs, target = recipe.on_device(batch)
            loss = recipe.loss(model, inputs, target)
            opt.zero_grad()
            loss.backward()  # the hook synchronises here
            if peer:
                state.after_backward()
            recipe.clip(model)
            _synchronize(device)  # (what backward and clipping queued on a GPU)
            t1 = time.perf_counter()
            opt.step()
            _synchronize(device)
            t2 = time.perf_counter()
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
            split = hook_clock()
            if split is not None and last_split is not None:
                compress_times.append(split[0] - last_split[0])
                comm_times.append(split[1] - last_split[1])
            last_split = split
            losses.append(float(loss.detach()))
            done += 1
            if done == warm_steps:
                warm_messages = messages_sent()
            bar.update(done, f"loss {losses[-1]:.3f}")
            if show and line_progress and time.monotonic() > next_line:
                next_line = time.monotonic() + 15
                log.info("%s %s: step %d/%d, loss %.3f", recipe_name, method, done, total,
                         losses[-1])  # fmt: skip
            if eval_every and done % eval_every == 0 and done < total:
                clock += time.perf_counter() - resumed
                evaluate(done / steps, done)
                resumed = time.perf_counter()
                if stop_after and at_target():
                    stopped = True
                    break
        if stopped:
            if comm.rank == 0:
                log.info("%s %s: target %s held for %d evaluations: stopped at step %d",
                         recipe_name, method, stop_target, stop_after, done)  # fmt: skip
            break
        clock += time.perf_counter() - resumed
        if not eval_every or epoch == epochs - 1:
            evaluate(float(epoch + 1), done)
    compute = _probe(model, recipe, probe_steps, comm) if probe_steps and not fsdp else []
    # every rank's mean loss per step, so the curve is the global training loss
    loss_t = comm.allreduce(torch.tensor(losses, dtype=torch.float64)) / comm.world_size
    bytes_t = comm.allreduce(torch.tensor(state.step_bytes, dtype=torch.float64))
    out: dict[str, Any] = {
        "losses": loss_t.tolist(),
        "step_bytes": (bytes_t / comm.world_size).tolist(),
        "step_times": step_times,
        "opt_times": opt_times,
        "compress_times": compress_times,
        "comm_times": comm_times,
        "train_s": clock,
        "evals": evals,
        "stopped_at_target": stopped,
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
    }
    if compute:
        out.update(compute_split(comm.allgather(torch.tensor(compute, dtype=torch.float64))))
    if peer:
        out["peer_hyper"] = dict(state.hyper)
    else:
        # messages this rank sent per step after the warm-up (the latency term of the
        # step's sync)
        stats = getattr(getattr(state, "comm", None), "stats", None)
        if stats is not None and done > warm_steps:
            out["messages_per_step"] = (messages_sent() - warm_messages) / (done - warm_steps)
    return out


def check_device(name: str) -> torch.device:
    """The device ``sparcml train --device NAME`` names: ``cpu``, ``cuda`` or
    ``cuda:N``. Raises ``ValueError`` naming what this machine lacks."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: not a device ({e})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: the harness trains on cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: this machine's PyTorch sees no CUDA device")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name!r}: this machine has {count} CUDA device(s)")
    return device


def training_device(name: str, rank: int) -> torch.device:
    """This rank's device for ``--device NAME`` (:func:`check_device`), made current:
    ``cuda`` is GPU ``LOCAL_RANK`` (else, and on ``sparcml cluster``'s emulated hosts,
    the rank) modulo the machine's GPUs."""
    import os

    device = check_device(name)
    if device.type == "cuda":
        index = device.index
        if index is None:
            # an emulated cluster's hosts all run here: each has LOCAL_RANK 0, so spread
            # its ranks by their rank
            emulated = "SPARCML_CLUSTER_RATE" in os.environ
            local = rank if emulated else int(os.environ.get("LOCAL_RANK", rank))
            index = local % torch.cuda.device_count()
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def agreed_device(comm: Any, name: str) -> torch.device:
    """:func:`training_device` on every rank, agreed: where some rank cannot use
    ``name`` (a host without a GPU in a mixed job), every rank raises ``ValueError``
    naming those ranks, instead of the others failing later in DDP's first message."""
    try:
        device, error = training_device(name, comm.rank), None
    except ValueError as e:
        device, error = torch.device("cpu"), e
    flags = torch.zeros(comm.world_size, dtype=torch.float64)
    flags[comm.rank] = float(error is not None)
    failed = [r for r, f in enumerate(comm.allreduce(flags).tolist()) if f]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"--device {name!r}: not available on rank(s) {failed}")
    return device


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_split(per_rank: list[torch.Tensor]) -> dict[str, float]:
    """The compute part of a step from every rank's probe times (:func:`_probe`, step
    ``i`` of every rank started together).

    ``compute_s``: the mean over the probe's steps of the slowest rank's time. A
    synchronous step ends no sooner than its slowest rank's backward, and the step
    times it is taken from are means over steps too, so the wait for the slower
    rank is compute, not sync. ``compute_rank_median_s``: the figure the harness
    reported before (each rank's median, mean over the ranks), which left that wait,
    and the slow steps a median drops, in the sync.
    """
    times = torch.stack(per_rank)  # ranks x steps
    medians = times.sort(dim=1).values[:, times.shape[1] // 2]  # (the upper of two)
    return {
        "compute_s": float(times.max(dim=0).values.mean()),
        "compute_rank_median_s": float(medians.mean()),
    }


def _probe(model: Any, recipe: Any, n: int, comm: Any) -> list[float]:
    """``n`` forward + backward passes without gradient synchronisation (DDP's
    ``no_sync``), every one started on all ranks together as in training (where the
    step's collective lines them up); their wall times. The model is not updated (no
    optimizer step); gradients are cleared afterwards."""
    times: list[float] = []
    batches = iter(recipe.batches(0))
    with model.no_sync():
        for _ in range(n):
            try:
                inputs, target = next(batches)
            except StopIteration:
                batches = iter(recipe.batches(0))
                inputs, target = next(batches)
            _barrier(comm)
            t0 = time.perf_counter()
            inputs, target = recipe.on_device((inputs, target))
            loss = recipe.loss(model, inputs, target)
            loss.backward()
            _synchronize(recipe.device)
            times.append(time.perf_counter() - t0)
    for p in model.parameters():
        p.grad = None
    _barrier(comm)
    return times


#: the run of ``sparcml train --config FILE`` is named ``config:NAME`` (the file's
#: name; its path travels as ``hyper["config"]``)
CONFIG_PREFIX = "config:"


def method_hyper(
    method: str, hyper: dict[str, Any], fsdp: bool = False, momentum: float = 0.9
) -> dict[str, Any]:
    """The hyperparameters ``method`` gets from the command line's ``hyper``.

    Density, momentum correction and index coding are for the sparse methods; sparse
    methods get DGC momentum correction with the recipe's ``momentum`` (none for a
    recipe trained with plain SGD) unless told otherwise, except under
    FSDP2 (``fsdp``), whose reduce-scatter has none (the optimizer keeps its
    momentum; an explicit ``momentum`` is refused there by ``register_fsdp``). PyTorch
    peers (:mod:`.peers`) take only the dense warm-up, as PowerSGD's ``start_iter``.
    """
    from ...torch.methods import method_spec
    from ...torch.peers import is_peer

    h = dict(hyper)
    config = h.pop("config", None)  # sparcml train --config: the file's path
    if method.startswith(CONFIG_PREFIX):  # that run: the file says it all
        return {"config": config}
    if is_peer(method):
        warm = int(h.get("warmup_steps", 0))
        return {"start_iter": warm} if method.startswith("powersgd") else {}
    if not method_spec(method).needs_momentum_correction:  # sends every entry
        h.pop("density", None)
        h.pop("momentum", None)  # momentum correction is for sparse methods
        h.pop("index_coding", None)
    elif "momentum" not in h and not fsdp and momentum:
        # error feedback and the optimizer's momentum amplify each other: sparse
        # methods get DGC momentum correction (the optimizer then runs without)
        h["momentum"] = momentum
    if h.get("index_coding") and "index_coding" not in method_spec(method).config.field_names():
        h.pop("index_coding")  # index coding applies to the sparse methods only
    if h.get("algorithm") and "algorithm" not in method_spec(method).config.field_names():
        h.pop("algorithm")  # the sparse allreduce algorithm: for the methods that run one
    return h


def within_target(final: float, higher_is_better: bool) -> float:
    """The figure a run must reach to be "within" dense's ``final``: one point of
    accuracy below it, or 3% of perplexity above it."""
    return final - 0.01 if higher_is_better else final * 1.03


def stop_order(methods: list[str], options: dict[str, Any]) -> list[str]:
    """``methods`` with the dense fp32 baseline first when runs stop at the target
    (``stop_after``) and no ``target`` is given: its final figure sets the target.

    Raises:
        ValueError: no target and no baseline (``ddp`` or ``dense``) to take it from.
    """
    if not options.get("stop_after") or options.get("target") is not None:
        return list(methods)
    base = next((m for m in ("ddp", "dense") if m in methods), None)
    if base is None:
        raise ValueError(
            "stopping at the target needs the dense baseline (ddp or dense) among the "
            "methods, or the target itself (--target)"
        )
    return [base, *(m for m in methods if m != base)]


def run_recipe(
    recipe_name: str,
    methods: list[str],
    world: int = 4,
    epochs: int | None = None,
    hyper: dict[str, Any] | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every method in turn on ``world`` local ranks; returns the runs by method."""
    from . import RECIPES

    if recipe_name not in RECIPES:
        raise ValueError(f"unknown recipe {recipe_name!r}; available: {', '.join(RECIPES)}")
    recipe_cls = RECIPES[recipe_name]
    recipe_cls.check_data()  # fail here, with the command to run, not inside every rank
    epochs = epochs or recipe_cls.epochs
    runs: dict[str, Any] = {}
    options = dict(options or {})
    for method in stop_order(methods, options):
        h = method_hyper(method, hyper or {}, bool(options.get("fsdp")), recipe_cls.momentum)
        server = None
        if method == "natural_ina" and "server" not in h:
            from ...ina import AggregatorServer

            server = AggregatorServer().start()  # an aggregator for this run, on loopback
            h["server"] = f"{server.address[0]}:{server.address[1]}"
        t0 = time.monotonic()
        try:
            out = run_processes(
                world, train_worker, recipe_name, method, h, epochs, seed, options,
                progress, timeout=600, deadline=6 * 3600,
            )  # fmt: skip
        finally:
            if server is not None:
                h["aggregator_counters"] = server.snapshot()
                h.pop("server")
                server.stop()
        run = out[0]
        if options.get("stop_after") and options.get("target") is None:
            final = float(run["evals"][-1][recipe_cls.metric])
            options["target"] = within_target(final, recipe_cls.higher_is_better)
        run["wall_s"] = time.monotonic() - t0
        run["hyper"] = h
        runs[method] = run
    return result_of(recipe_name, recipe_cls, world, epochs, seed, options or None, runs)


def result_of(
    recipe_name: str, recipe_cls: Any, world: int, epochs: int, seed: int,
    options: dict[str, Any] | None, runs: dict[str, Any], **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A recipe run's result: its configuration and the runs by method."""
    return {
        "recipe": recipe_name,
        "world": world,
        "epochs": epochs,
        "seed": seed,
        "metric": recipe_cls.metric,
        "higher_is_better": recipe_cls.higher_is_better,
        "options": options or {},
        **extra,
        "runs": runs,
    }


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None without the bench extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def join_recipe(
    recipe_name: str,
    methods: list[str],
    epochs: int | None = None,
    hyper: dict[str, Any] | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    progress: bool = True,
    timeout: float = 600.0,
) -> dict[str, Any] | None:
    """:func:`run_recipe` as one rank of a torchrun / ``sparcml cluster`` job (env://).

    Every rank calls it; each method runs in turn on the job's ranks. Returns the
    result on rank 0, ``None`` on the others.
    """
    import os

    import torch.distributed as dist

    from ...comm import TorchDistCommunicator
    from . import RECIPES

    if recipe_name not in RECIPES:
        raise ValueError(f"unknown recipe {recipe_name!r}; available: {', '.join(RECIPES)}")
    recipe_cls = RECIPES[recipe_name]
    recipe_cls.check_data()
    epochs = epochs or recipe_cls.epochs
    import datetime

    # gloo's own timeout too: a stuck collective fails the job instead of waiting 30 min
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    comm = TorchDistCommunicator(timeout=timeout)
    runs: dict[str, Any] = {}
    options = dict(options or {})
    methods = stop_order(methods, options)
    try:
        for method in methods:
            h = method_hyper(method, hyper or {}, bool(options.get("fsdp")), recipe_cls.momentum)
            t0, ticks = time.monotonic(), cpu_times()
            run = train_worker(comm, recipe_name, method, h, epochs, seed, options, progress)
            if options.get("stop_after") and options.get("target") is None:
                # the baseline ran first: its "within" figure is every later run's target
                mine = run["evals"][-1].get(recipe_cls.metric, 0.0) if comm.rank == 0 else 0.0
                final = float(comm.allreduce(torch.tensor([mine], dtype=torch.float64))[0])
                options["target"] = within_target(final, recipe_cls.higher_is_better)
            run["wall_s"] = time.monotonic() - t0
            run["hyper"] = h
            # the machine's load when the run ended (1, 5, 15 min): other work on shared cores
            run["loadavg"] = list(os.getloadavg())
            # and the host's: CPU time a virtual machine's host took for other guests
            run["cpu_steal"] = steal_share(ticks, cpu_times())
            runs[method] = run
            if comm.rank == 0:
                log.info("%s %s: done, %.1f s of training (%.1f s in all)", recipe_name,
                         method, run["train_s"], run["wall_s"])  # fmt: skip
                if (run["cpu_steal"] or 0.0) > STEAL_FLAG:
                    log.warning(
                        "%s %s: the host took %.1f%% of this machine's CPU time during the "
                        "run (steal): its times are slower than the machine's own; compare "
                        "runs made on a quiet host", recipe_name, method,
                        100 * run["cpu_steal"],
                    )  # fmt: skip
        world, rank = comm.world_size, comm.rank
    finally:
        comm.close()
        dist.destroy_process_group()
    if rank != 0:
        return None
    return result_of(
        recipe_name, recipe_cls, world, epochs, seed, options, runs,
        link_rate=os.environ.get("SPARCML_CLUSTER_RATE"),
        link=os.environ.get("SPARCML_CLUSTER_LINK"),
    )  # fmt: skip


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _hook_clock(state: Any) -> Callable[[], tuple[float, float] | None]:
    """Seconds of compression and of communication the sparcml hook has spent so far
    (every parameter group), or None for PyTorch's own hooks."""
    groups = [st for st in (state, *getattr(state, "children", ())) if hasattr(st, "stats")]
    if not groups or not all(hasattr(st.stats, "compress_s") for st in groups):
        return lambda: None

    def clock() -> tuple[float, float]:
        return (
            sum(st.stats.compress_s for st in groups),
            sum(st.stats.communicate_s for st in groups),
        )

    return clock


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Final figures per method; bytes and times averaged over the steps after the
    dense warm-up (``warmup_steps``), when there is one. Times also leave out the
    first step (one-time work: loading compiled kernels, first allocations), which
    is reported on its own (``first_step_ms``)."""
    metric = result["metric"]

    def warm(run: dict[str, Any]) -> int:
        return int(run.get("hyper", {}).get("warmup_steps", 0))

    def ms(values: list[float] | None, start: int) -> float | None:
        return 1000 * _mean(values[start:]) if values and len(values) > start else None

    dense = result["runs"].get("dense") or result["runs"].get("ddp")
    dense_bytes = _mean(dense["step_bytes"][warm(dense) :]) if dense else None
    rows = []
    for method, run in result["runs"].items():
        final = run["evals"][-1]
        warmup = warm(run)
        steady = max(warmup, 1) if len(run["step_times"]) > 1 else warmup
        b = _mean(run["step_bytes"][warmup:])
        compute_s = run.get("compute_s")
        rows.append(
            {
                "method": method,
                metric: final[metric],
                "test_loss": final["test_loss"],
                "bytes_per_step": b,
                "fewer_bytes_than_dense": (dense_bytes / b) if dense_bytes and b else None,
                "ms_per_step": ms(run["step_times"], steady),
                "first_step_ms": 1000 * run["step_times"][0] if run["step_times"] else None,
                "compute_ms": 1000 * compute_s if compute_s is not None else None,
                "compress_ms": ms(run.get("compress_times"), steady),
                "communicate_ms": ms(run.get("comm_times"), steady),
                "final_train_loss": _mean(run["losses"][-20:]),
            }
        )
    base = next((r for r in rows if r["method"] in ("dense", "ddp")), None)
    for r in rows:
        r["step_vs_dense"] = (
            r["ms_per_step"] / base["ms_per_step"]
            if base and base["ms_per_step"] and r["ms_per_step"]
            else None
        )
    return rows


def format_table(result: dict[str, Any]) -> str:
    metric = result["metric"]
    head = (
        f"| method | test {metric} | test loss | bytes sent per step (per rank) "
        "| fewer bytes than dense | ms per step | vs dense | compute ms | compression ms "
        "| communication ms | first step ms |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def num(x: float | None, fmt: str = ".1f", unit: str = "") -> str:
        return "-" if x is None else f"{x:{fmt}}{unit}"

    for r in summary_rows(result):
        value = f"{100 * r[metric]:.2f}%" if metric == "accuracy" else f"{r[metric]:.3f}"
        lines.append(
            f"| {r['method']} | {value} | {r['test_loss']:.4f} | {r['bytes_per_step']:,.0f} "
            f"| {num(r['fewer_bytes_than_dense'], '.1f', 'x')} | {num(r['ms_per_step'])} "
            f"| {num(r['step_vs_dense'], '.2f', 'x')} | {num(r['compute_ms'])} "
            f"| {num(r['compress_ms'])} | {num(r['communicate_ms'])} "
            f"| {num(r['first_step_ms'], '.0f')} |"
        )
    return "\n".join(lines)


def write_report(result: dict[str, Any], out: Path, command: str) -> list[Path]:
    """Write ``results.json``, ``results.md`` (table + command) and plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    config = {k: v for k, v in result.items() if k != "runs"}
    write_json(out / "results.json", "train", result["runs"], config, command=command, **config)
    written.append(out / "results.json")
    md = [
        f"# {result['recipe']}: {result['world']} ranks, {result['epochs']} epochs",
        "",
        f"Command: `{command}`",
        "",
        "Hyperparameters per method: "
        + "; ".join(f"{m}: {r.get('hyper', {})}" for m, r in result["runs"].items())
        + " (bytes per step: mean over the steps after any dense warm-up; ms per step: the "
        "same without the first step, whose one-time work is shown on its own; compute: a "
        "step without communication, measured after training, the slowest rank's; "
        "compression and "
        "communication: the sparcml hook's own clock per step, which overlaps backward; "
        "time per step on the machine(s) that ran the ranks, indicative only)",
        "",
        format_table(result),
        "",
    ]
    (out / "results.md").write_text("\n".join(md))
    written.append(out / "results.md")
    plt = pyplot()
    if plt is None:  # plots need the bench extra
        return written
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    metric = result["metric"]
    for method, run in result["runs"].items():
        losses = torch.tensor(run["losses"])
        w = max(1, len(losses) // 100)
        smooth = losses.unfold(0, w, w).mean(1) if len(losses) >= w else losses
        axes[0].plot([(i + 0.5) * w for i in range(len(smooth))], smooth.tolist(), label=method)
        axes[1].plot(
            [e["epoch"] for e in run["evals"]],
            [e[metric] for e in run["evals"]],
            marker="o",
            label=method,
        )
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss (mean over ranks)")
    axes[0].set_yscale("log")
    axes[1].set_xlabel("epoch")
    from matplotlib.ticker import MaxNLocator

    if result["epochs"] > 2:  # (shorter runs evaluate within epochs: fractional ticks)
        axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_ylabel(f"test {metric}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['recipe']}, {result['world']} ranks")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    written.append(out / "curves.png")
    return written
