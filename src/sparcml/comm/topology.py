"""Node topology: which ranks share a node, and sub-communicators for the two levels.

SparCML's production run composed two levels (paper 000, sec. 8; summary sheet
003): NCCL inside each 4-GPU node, the sparse allreduce between nodes. A
:class:`Topology` says which ranks share a node (and so a NIC); a
:class:`SubCommunicator` is a group of a communicator's ranks that runs any
collective among themselves over the parent's links. Every backend gets both at
once, because a group only renames ranks on the parent's point-to-point
primitives: gloo, NCCL, MPI, the in-process ranks and the simulator alike.

Where the topology comes from (:func:`detect_topology`, run once per
communicator on first use, a collective every rank reaches at the same call):

1. an explicit one: ``comm.set_topology(Topology.regular(P, 4))``;
2. ``SPARCML_RANKS_PER_NODE=L``: ranks ``0..L-1`` on node 0, and so on (the
   launch order of torchrun and ``mpirun --map-by node:PE=...`` by slot);
3. ``LOCAL_WORLD_SIZE`` equal to the world size (torchrun on one node, the test
   launcher), or ranks in one process (in-process and simulated ranks): one node,
   no message;
4. the launcher's node identity: ``GROUP_RANK`` (torchrun's node rank, also set
   by ``sparcml cluster --nodes``), else the MPI shared-memory split
   (:meth:`~sparcml.comm.Communicator.node_key`), else the host name.

Irregular topologies (nodes with different numbers of ranks) are refused with a
:class:`TopologyError` naming the nodes and their sizes: the two-level
algorithms pair the ``l``-th rank of every node, and a node without an
``l``-th rank would leave a lane without a partner. Ranks need not be
contiguous on a node; each node's ranks are taken in ascending order. (The
papers assume regular nodes; the refusal is ours.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
from collections.abc import Iterator, Sequence

import torch

from ..errors import CommError
from .base import Communicator, Handle

__all__ = [
    "SubCommunicator",
    "Topology",
    "TopologyError",
    "detect_topology",
    "local_topology",
    "node_identity",
]


class TopologyError(ValueError):
    """The ranks' node layout cannot be used (irregular nodes, a bad explicit layout)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """The node of every rank: ``nodes[n]`` lists the ranks on node ``n``, ascending.

    Attributes:
        nodes: one tuple of ranks per node, every node the same size; nodes are
            ordered by their lowest rank.
    """

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        # one spelling per layout: each node ascending, nodes by their lowest rank (the
        # same nodes given in another order must pair the same ranks on every rank)
        canonical = tuple(
            sorted((tuple(sorted(int(r) for r in n)) for n in self.nodes), key=lambda n: n[:1])
        )
        object.__setattr__(self, "nodes", canonical)
        ranks = sorted(r for node in self.nodes for r in node)
        if not self.nodes or ranks != list(range(len(ranks))):
            raise TopologyError(
                f"a topology must place every rank 0..P-1 on exactly one node, got {self.nodes}"
            )
        sizes = sorted({len(node) for node in self.nodes})
        if len(sizes) != 1:
            detail = ", ".join(f"node {i}: {len(n)} ranks" for i, n in enumerate(self.nodes))
            raise TopologyError(
                f"irregular nodes ({detail}): the two-level algorithms pair the l-th rank "
                "of every node, so every node must hold the same number of ranks; run "
                "flat (set SPARCML_RANKS_PER_NODE=1) or launch the same number per node"
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def regular(cls, world_size: int, ranks_per_node: int) -> Topology:
        """Contiguous nodes of ``ranks_per_node`` ranks (``P`` must be a multiple)."""
        if ranks_per_node < 1 or world_size < 1 or world_size % ranks_per_node:
            raise TopologyError(
                f"{world_size} ranks cannot form nodes of {ranks_per_node} ranks each "
                "(the world size must be a positive multiple of the ranks per node)"
            )
        return cls(
            tuple(tuple(range(n, n + ranks_per_node)) for n in range(0, world_size, ranks_per_node))
        )

    @classmethod
    def flat(cls, world_size: int) -> Topology:
        """Every rank its own node (what every algorithm assumed before topologies)."""
        return cls.regular(world_size, 1)

    @classmethod
    def from_keys(cls, keys: Sequence[object]) -> Topology:
        """Group ranks by node key (``keys[r]`` names rank ``r``'s node)."""
        groups: dict[object, list[int]] = {}
        for r, k in enumerate(keys):
            groups.setdefault(k, []).append(r)
        return cls(tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: g[0])))

    # ------------------------------------------------------------------ facts
    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[0])

    @property
    def is_flat(self) -> bool:
        """One level only: a single node, or one rank per node."""
        return self.num_nodes == 1 or self.ranks_per_node == 1

    @functools.cached_property
    def _place(self) -> dict[int, tuple[int, int]]:
        """Every rank's (node, local rank), built once (lookups are O(1) at any P)."""
        return {r: (i, j) for i, node in enumerate(self.nodes) for j, r in enumerate(node)}

    def node_of(self, rank: int) -> int:
        return self._place[rank][0]

    def local_rank(self, rank: int) -> int:
        return self._place[rank][1]

    def node_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s node (the intra-node group)."""
        return self.nodes[self.node_of(rank)]

    def lane_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks with ``rank``'s local rank on every node (its inter-node group)."""
        lane = self.local_rank(rank)
        return tuple(n[lane] for n in self.nodes)

    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of every node."""
        return tuple(n[0] for n in self.nodes)

    def __str__(self) -> str:
        return f"{self.num_nodes} node(s) x {self.ranks_per_node} rank(s)"


def node_identity() -> str | None:
    """This process's node from the environment: ``GROUP_RANK`` (torchrun's node rank,
    also set by ``sparcml cluster --nodes``), or None when the launcher did not say."""
    value = os.environ.get("GROUP_RANK", "").strip()
    return f"group:{value}" if value else None


def _key_code(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def detect_topology(comm: Communicator) -> Topology:
    """The node layout of ``comm``'s ranks (a collective: every rank calls it once).

    See the module docstring for the order of sources. ``SPARCML_RANKS_PER_NODE``
    needs no messages; otherwise every rank's node key is gathered (one 8-byte
    allgather) and the ranks grouped by it.

    Raises:
        TopologyError: irregular nodes, or ``SPARCML_RANKS_PER_NODE`` does not
            divide the world size (on every rank alike).
    """
    found = local_topology(comm)
    if found is not None:
        return found
    code = _key_code(comm.node_key())
    keys = [int(k.item()) for k in comm.allgather(torch.tensor([code], dtype=torch.int64))]
    if isinstance(comm, SubCommunicator):
        return _regular_or_flat(keys)
    return Topology.from_keys(keys)


def local_topology(comm: Communicator) -> Topology | None:
    """The layout of ``comm``'s ranks known or found without messages, or None (then
    only gathering the ranks' node keys tells): one rank; a layout set or detected
    already; for a group, its members' nodes in such a layout of its parent; the
    explicit ``SPARCML_RANKS_PER_NODE`` (contiguous nodes of the world's ranks); a
    launcher that started the whole job on one node; in-process ranks (one host)."""
    p = comm.world_size
    if p == 1:
        return Topology.flat(1)
    known = comm.known_topology
    if known is not None:
        return known  # type: ignore[no-any-return]
    if isinstance(comm, SubCommunicator):
        # a group's nodes are its parent's: never messages on the parent here (only
        # the members reach this); members spread unevenly over the nodes run flat
        outer = local_topology(comm.parent)
        return None if outer is None else _regular_or_flat([outer.node_of(m) for m in comm.members])
    env = os.environ.get("SPARCML_RANKS_PER_NODE", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise TopologyError(f"SPARCML_RANKS_PER_NODE must be a positive integer, got {env!r}")
        return Topology.regular(p, int(env))
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local and local == os.environ.get("WORLD_SIZE", "").strip():
        # the launcher started the whole job on this node (torchrun, run_processes)
        return Topology.regular(p, p)
    if comm.one_process:  # in-process ranks share a host: one node unless set explicitly
        return Topology.regular(p, p)
    return None


def _regular_or_flat(keys: Sequence[object]) -> Topology:
    """The ranks grouped by node key; flat where the groups are irregular (a group's
    members spread unevenly over its parent's nodes)."""
    try:
        return Topology.from_keys(keys)
    except TopologyError:
        return Topology.flat(len(keys))


class SubCommunicator(Communicator):
    """The ranks ``members`` of ``parent`` as a communicator of their own.

    Rank ``i`` here is ``parent`` rank ``members[i]``. Messages travel on the
    parent's links through its public :meth:`isend` / :meth:`irecv` (global ranks,
    the same tags), so traffic is counted in the parent's ``stats`` (and here),
    an abort note from any rank of the parent fails a receive here, and a timeout
    names the parent's rank. The collectives here are the generic ones of
    :class:`~sparcml.comm.base.Communicator` (ring allreduce, ring allgatherv,
    direct all-to-all), built on those messages. A group is used inside a call of
    its parent (the two-level algorithms); the parent's call numbering and failure
    handling apply.
    """

    def __init__(self, parent: Communicator, members: Sequence[int]) -> None:
        members = tuple(int(m) for m in members)
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not a member of the group {members}")
        if len(set(members)) != len(members) or not all(
            0 <= m < parent.world_size for m in members
        ):
            raise ValueError(f"invalid group {members} of a world of {parent.world_size}")
        super().__init__(members.index(parent.rank), len(members), parent.timeout)
        self.parent = parent
        self.members = members
        self.device = parent.device
        self.agrees_on_failures = parent.agrees_on_failures
        self.one_process = parent.one_process

    @property  # type: ignore[override]
    def receives_first(self) -> bool:  # (the parent's transport's order, as it is now)
        return self.parent.receives_first

    def now(self) -> float:
        return self.parent.now()

    def node_key(self) -> str:
        return self.parent.node_key()

    def isend(
        self, buf: torch.Tensor, dst: int, tag: int = 0, *, after: Handle | None = None
    ) -> Handle:
        self._check_peer(dst, "destination")
        h = self.parent.isend(buf, self.members[dst], tag, after=after)
        self.stats.bytes_sent += buf.numel()
        self.stats.messages_sent += 1
        return h

    def irecv(self, src: int, tag: int = 0) -> Handle:
        self._check_peer(src, "source")
        inner = self.parent.irecv(self.members[src], tag)
        stats = self.stats

        def counted() -> torch.Tensor | None:
            out = inner.wait()
            assert out is not None
            stats.bytes_recv += out.numel()
            stats.messages_recv += 1
            return out

        return Handle(counted, inner.progress, owner=inner)

    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:  # pragma: no cover
        raise CommError("a group sends through its parent's isend")

    def _irecv(self, src: int, tag: int) -> Handle:  # pragma: no cover
        raise CommError("a group receives through its parent's irecv")

    def check_usable(self) -> None:
        self.parent.check_usable()

    @contextlib.contextmanager
    def control(self) -> Iterator[None]:
        """Control traffic here is the parent's too: its messages travel there."""
        with super().control(), self.parent.control():
            yield
