"""Peers in the benchmark: PyTorch's own DDP compression hooks on the same vectors.

``torch_fp16_hook`` is PyTorch's ``fp16_compress_hook`` (cast to float16,
gloo/NCCL ring allreduce, cast back) and ``torch_powersgd_hook`` its
``powerSGD_hook`` (``torch.distributed.algorithms.ddp_comm_hooks``)
(rank-``r`` PowerSGD, Vogels et al.), both called exactly as DDP calls them, on a
bucket holding the benchmark's vector densified. PowerSGD compresses matrices,
so the vector is viewed as the squarest ``rows x cols`` matrix whose product is
``N`` (a 1-D tensor would be allreduced uncompressed); it runs without error
feedback or warm start (one call, no history to feed back).

Both hooks average; the benchmark multiplies by ``P`` to compare with the sum.
fp16 must match the float64 sum within float16 rounding; PowerSGD is a low-rank
approximation, so its row reports the relative error it makes and the check is
that every rank holds the same bits.

Bytes: the hooks call torch.distributed directly, so the figure is the ring
volume of what they reduce, ``2 (P-1)/P`` times the bytes: ``2N`` for fp16,
``4 r (rows + cols)`` for PowerSGD (its two factor allreduces).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["PEERS", "HierarchicalDense", "PeerRunner"]

PEERS = ("torch_fp16_hook", "torch_powersgd_hook")


def matrix_shape(n: int) -> tuple[int, int]:
    """The squarest ``(rows, cols)`` with ``rows * cols == n``, ``rows <= cols``."""
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows


class _Bucket:
    """Duck-typed :class:`torch.distributed.GradBucket` holding one flat buffer."""

    def __init__(self, buffer: torch.Tensor, shape: tuple[int, int]) -> None:
        self._buffer = buffer
        self._shape = shape

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.view(self._shape)]

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer.view(self._shape)]

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class PeerRunner:
    """Calls one PyTorch hook on a dense vector in a torch.distributed group.

    Args:
        name: one of :data:`PEERS`.
        group: the process group the hook communicates over.
        rank_r: PowerSGD's ``matrix_approximation_rank``.
    """

    def __init__(self, name: str, group: Any, world_size: int, rank_r: int = 4) -> None:
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; choose from {PEERS}")
        self.name = name
        self.group = group
        self.world_size = world_size
        self.rank_r = rank_r
        self._state: Any = None

    def __call__(self, dense: torch.Tensor) -> torch.Tensor:
        """The hook's result times ``P`` (the sum), for the float32 vector ``dense``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        buf = dense.detach().to(torch.float32).clone()
        shape = matrix_shape(buf.numel())
        bucket: Any = _Bucket(buf, shape)
        if self.name == "torch_fp16_hook":
            fut = default_hooks.fp16_compress_hook(self.group, bucket)
        else:
            if self._state is None:
                self._state = powerSGD_hook.PowerSGDState(
                    process_group=self.group,
                    matrix_approximation_rank=self.rank_r,
                    start_powerSGD_iter=1,
                    min_compression_rate=0,
                    use_error_feedback=False,
                    warm_start=False,
                    random_seed=0,
                )
            fut = powerSGD_hook.powerSGD_hook(self._state, bucket)
        return fut.wait() * self.world_size

    def bytes_sent(self, n: int) -> float:
        """Ring volume per rank of one call (see the module docstring)."""
        p = self.world_size
        ring = 2 * (p - 1) / p
        if self.name == "torch_fp16_hook":
            return ring * 2 * n
        rows, cols = matrix_shape(n)
        return ring * 4 * self.rank_r * (rows + cols)


class HierarchicalDense:
    """Horovod's hierarchical allreduce on gloo's own collectives: the dense two-level
    baseline next to the two-level sparse algorithms (issue 31).

    Every rank creates the node groups and the lane groups (``torch.distributed.new_group``,
    all ranks, same order) once; a call then runs a reduce-scatter inside the
    node, ``all_reduce`` of the shard between nodes (the ranks with the same local
    rank), and an allgather inside the node.

    Args:
        topology: the ranks' :class:`~sparcml.comm.topology.Topology` (several nodes
            of several ranks).
        rank: this rank in the default group.
    """

    def __init__(self, topology: Any, rank: int) -> None:
        import torch.distributed as dist

        self.per_node = topology.ranks_per_node
        self.nodes = topology.num_nodes
        self.node: Any = None
        self.lane: Any = None
        for members in topology.nodes:
            group = dist.new_group(list(members))
            if rank in members:
                self.node = group
        for local in range(self.per_node):
            members = [n[local] for n in topology.nodes]
            group = dist.new_group(members)
            if rank in members:
                self.lane = group

    def __call__(self, dense: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's float32 vector ``dense``."""
        import torch.distributed as dist

        n = dense.numel()
        pad = (-n) % self.per_node
        flat = torch.cat([dense, dense.new_zeros(pad)]) if pad else dense.clone()
        shard = flat.new_empty(flat.numel() // self.per_node)
        # torch 2.13 renamed these (the old names warn); torch >= 2.3 has the old ones
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        reduce_scatter(shard, flat, group=self.node)
        dist.all_reduce(shard, group=self.lane)
        out = flat.new_empty(flat.numel())
        all_gather(out, shard, group=self.node)
        return out[:n]

    def bytes_sent(self, n: int, isize: int = 4) -> float:
        """Ring volumes per rank: ``(L-1)/L N`` in each intra-node phase and
        ``2 (n-1)/n N/L`` between nodes."""
        inside = 2 * (self.per_node - 1) / self.per_node * n * isize
        return inside + 2 * (self.nodes - 1) / self.nodes * n / self.per_node * isize
