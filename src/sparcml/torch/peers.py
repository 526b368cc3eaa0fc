"""PyTorch's own gradient synchronisation, by name: the baselines users compare with.

:func:`sparcml.torch.register` takes these names too (``register(model, "powersgd")``),
so one call covers sparcml's methods and PyTorch's; ``sparcml train`` runs them as
peers in the same harness. They are PyTorch's code, not sparcml's: no consistency
header, no layer rules; the state returned counts the bytes each rank sends.

* ``ddp``: plain DDP, no communication hook (gloo's ring allreduce of float32 buckets);
* ``fp16`` / ``bf16``: ``torch.distributed.algorithms.ddp_comm_hooks``'
  ``fp16_compress_hook`` / ``bf16_compress_hook`` (the bucket cast to 16 bits,
  allreduced, cast back);
* ``powersgd`` (rank 2), ``powersgdR`` (rank ``R``, e.g. ``powersgd4``): PyTorch's
  ``powerSGD_hook`` with the settings its documentation recommends: warm start,
  error feedback, and vanilla allreduce for the first ``start_powerSGD_iter`` steps.

Bytes are what gloo's ring sends per rank for the tensors the hook allreduces,
``2 (P-1)/P`` of their size, the same rule sparcml counts its ``dense`` method by;
PowerSGD's are computed per bucket from the sizes of its ``P`` and ``Q`` factors
and of the tensors it leaves uncompressed (PyTorch's rule: 1-D tensors, and
matrices where the factors would not save ``min_compression_rate`` times).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PEERS", "PeerState", "is_peer", "peer_rank", "pytorch_method", "register_peer"]

PEERS = ("ddp", "fp16", "bf16", "powersgd")
_POWERSGD = re.compile(r"^powersgd([1-9][0-9]*)?$")


def is_peer(method: str) -> bool:
    """Whether ``method`` names a PyTorch peer (``ddp``, ``fp16``, ``bf16``, ``powersgd[R]``)."""
    return method in ("ddp", "fp16", "bf16") or bool(_POWERSGD.match(method))


def pytorch_method(method: str) -> bool:
    """Whether :func:`sparcml.torch.register` hands ``method`` to PyTorch's own code:
    ``ddp`` (no hook) and ``powersgd[R]`` (``fp16``/``bf16`` are sparcml methods there,
    bit for bit PyTorch's hooks, with sparcml's checks and statistics)."""
    return method == "ddp" or bool(_POWERSGD.match(method))


def peer_rank(method: str) -> int:
    """PowerSGD's ``matrix_approximation_rank`` for ``powersgd`` (2) or ``powersgdR``."""
    m = _POWERSGD.match(method)
    if not m:
        raise ValueError(f"{method!r} is not a PowerSGD method")
    return int(m.group(1) or 2)


def _ring(nbytes: float, world: int) -> float:
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


class PeerState:
    """What the harness reads from a method's state: ``step_bytes`` (per step, this rank),
    ``method`` and ``hyper``; plus the PyTorch hook's own state, if any."""

    def __init__(self, method: str, world: int, hyper: dict[str, Any]) -> None:
        self.method, self.world, self.hyper = method, world, hyper
        self.step_bytes: list[int] = []
        self.hook_state: Any = None
        self.fixed_step_bytes: float | None = None  # plain DDP: no hook to count in
        self.params: list[torch.Tensor] = []  # plain DDP: its parameters
        self._pending = 0.0

    def after_backward(self) -> None:
        """Called by the harness after every backward (counts plain DDP's bytes).

        A dense gradient costs what gloo's ring allreduce sends for it; a sparse one
        (``nn.EmbeddingBag(..., sparse=True)``) goes through gloo's sparse allreduce,
        an allgather of every rank's indices and values: ``(P - 1) / P`` of the
        gathered entries, estimated from the summed gradient's entries (a lower
        bound where the ranks' rows overlap)."""
        if self.fixed_step_bytes is None:
            return
        nbytes = self.fixed_step_bytes
        for p in self.params:
            g = p.grad
            if g is None or not g.is_sparse:
                continue
            nbytes -= _ring(p.numel() * p.element_size(), self.world)
            g = g.coalesce()
            values = g.values()
            entry = (
                8 * g.sparse_dim() + values[0].numel() * values.element_size() if len(values) else 0
            )
            nbytes += (self.world - 1) / self.world * g.indices().shape[1] * entry
        self.add(nbytes, True)

    def add(self, nbytes: float, last: bool) -> None:
        self._pending += nbytes
        if last:
            self.step_bytes.append(round(self._pending))
            self._pending = 0.0


def _powersgd_bucket_bytes(ps: Any, grads: list[torch.Tensor], world: int) -> float:
    """Bytes one rank sends for one bucket under PowerSGD (before the hook runs)."""
    if ps.iter < ps.start_powerSGD_iter:
        return _ring(sum(g.numel() * g.element_size() for g in grads), world)
    plain = 0
    factors = 0
    for g in grads:
        if g.ndim <= 1:
            plain += g.numel()
            continue
        rows = g.shape[0]
        cols = g.numel() // rows
        r = min(rows, cols, ps.matrix_approximation_rank)
        if (rows + cols) * r * ps.min_compression_rate < rows * cols:
            factors += (rows + cols) * r
        else:
            plain += g.numel()
    # the uncompressed tensors, then P, then Q: three allreduces of float32
    return _ring(4.0 * (plain + factors), world)


def register_peer(
    model: torch.nn.parallel.DistributedDataParallel,
    method: str,
    *,
    start_iter: int = 0,
) -> PeerState:
    """Install PyTorch's ``method`` on a DDP model; returns a state counting its bytes.

    Args:
        model: a ``DistributedDataParallel`` model.
        method: ``ddp`` (no hook), ``fp16``, ``bf16``, ``powersgd`` (rank 2) or
            ``powersgdR`` (rank ``R``).
        start_iter: PowerSGD's ``start_powerSGD_iter`` (vanilla allreduce first; at
            least 2, PyTorch's minimum with error feedback).

    Raises:
        ValueError: not a PyTorch peer method.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if not is_peer(method):
        raise ValueError(f"unknown PyTorch peer method {method!r}; known: {', '.join(PEERS)}")
    world = dist.get_world_size()
    hyper: dict[str, Any] = {}
    state = PeerState(method, world, hyper)
    if method == "ddp":
        # no hook: count what gloo's ring sends for the float32 gradient, once per step
        state.params = [p for p in model.parameters() if p.requires_grad]
        state.fixed_step_bytes = _ring(
            sum(p.numel() * p.element_size() for p in state.params), world
        )
        return state
    if method in ("fp16", "bf16"):
        hooks = default_hooks
        inner = hooks.fp16_compress_hook if method == "fp16" else hooks.bf16_compress_hook

        def hook16(st: PeerState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            st.add(_ring(2.0 * bucket.buffer().numel(), st.world), bucket.is_last())
            return inner(None, bucket)

        model.register_comm_hook(state, _annotated(hook16))
        return state
    rank = peer_rank(method)
    ps = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=max(2, start_iter),  # PyTorch requires >= 2 with error feedback
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    hyper.update(
        matrix_approximation_rank=rank,
        start_powerSGD_iter=ps.start_powerSGD_iter,
        use_error_feedback=True,
        warm_start=True,
        min_compression_rate=ps.min_compression_rate,
    )
    state.hook_state = ps

    def hook_psgd(st: PeerState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        st.add(_powersgd_bucket_bytes(ps, bucket.gradients(), st.world), bucket.is_last())
        return psgd.powerSGD_hook(ps, bucket)

    model.register_comm_hook(state, _annotated(hook_psgd))
    return state


def _annotated(fn: Any) -> Any:
    """DDP checks a hook's annotations as objects; this module's are postponed strings."""
    fn.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return fn
