"""A simulated transport with a virtual clock: the real collective code, timed by the model.

:func:`simulate_ranks` runs an SPMD function on ``P`` in-process ranks (threads,
like :func:`~sparcml.comm.local.run_ranks`) whose communicators move the real
payloads but keep time on a **virtual clock** driven by the calibrated
alpha-beta-gamma model (paper 000, sec. 5.2, "Analytical Model"), not by the
wall clock. How long the threads really take does not matter: every rank's
time is computed from message timestamps, so the prediction is deterministic.

Point-to-point messages (recursive doubling, gTopk's tree, Ok-Topk's balanced
allgather):

* A send of ``L`` bytes at rank clock ``t`` starts when the rank's outgoing link
  is free, ``s = max(t, tx_free)``; the link is busy until ``s + beta L``; the
  message is ready at the receiver at ``s + alpha + beta L``. Waiting for the
  send moves the sender's clock to ``s + beta L``.
* A receive completes at ``a = max(ready, rx_free + beta L)`` (the incoming link
  carries one message at a time, in the order the code receives them); the
  receiver's clock becomes ``max(clock, a) + gamma E`` for the ``E`` elements the
  message carries (the local reduction the model charges per element).

Collectives the transport offers as a whole (dense ``allreduce`` and
``allgather``, ``allgatherv``, ``alltoallv``) are *synchronising*: they start
when the last rank arrives and cost the closed form of the algorithm a library
would pick (ring or recursive doubling for allreduce, recursive doubling for
allgather, direct for all-to-all; written at each method). Doing them as a
rendezvous keeps the simulation at ``O(P)`` Python work per collective instead of
``O(P^2)`` messages.

**Scaled data** (memory-light, for thousands of ranks): the ranks hold vectors of
``N / s`` with ``k / s`` pairs; the transport charges what the full-size message
would cost, through a ``charge`` function the caller passes (this module knows
nothing of what payloads hold; :func:`sparcml.tools.simulate.charge` reads the wire
format: ``nnz`` and dense lengths multiplied by ``s``, indices at the width the
full dimension needs). By default payloads are charged ``s`` times their
length (:func:`bytes_charge`), unless sent inside
:meth:`~sparcml.comm.base.Communicator.control` (metadata such as
``sparse_allreduce``'s consistency check). A dense-collective payload of at
least ``N / (s P)`` elements (a partition of the vector or more) is data and
charged ``s`` times; smaller ones (counts, thresholds, quantiles) are control
and charged as they are. Uniformly random indices keep their expected fill-in
fraction under this scaling (Appendix B.1's formula depends on ``k / N`` only).

**Local work** is either modelled (``gamma`` per received element, the default)
or *measured* (``compute="measured"``): a rank's time between communication calls
is timed for real — only one rank runs at a time, on one core — and charged
times ``cpu_share`` (ranks sharing a core on the machine predicted). Measured
compute includes what the model leaves out (selection, encoding, Python
overhead) and is as noisy as the machine running the simulation.

**Nodes** (``topology=``, beyond paper 000's one alpha-beta pair): messages
between two ranks of a node cost ``alpha_intra + beta_intra L`` on the rank's own
links; messages between nodes queue on the sending node's NIC and the receiving
node's, shared by the node's ranks, in the order of the ranks' virtual clocks
(ties: the lower rank): the rank threads take turns by a scheduler that always
runs the ready rank of the earliest virtual time (``_Turns``), so a simulation with
modelled compute repeats to the bit. (Before, a plain lock let the threads reach a NIC in the
order the operating system ran them: a rank of a later clock could book the NIC
first, and ``twolevel_shard``'s rows, whose lanes share the NIC, came out 1.5x to
2.4x too slow (docs/results/cluster/twolevel/sim_inner/before_turns/ against the
rerun) and different in every run.) The synchronising collectives charge
a rank's transfers from other nodes at ``beta`` times the ranks per node (every
rank sends at once) and inside the node at ``beta_intra``; the dense allreduce
keeps the ring's closed form (its neighbours are adjacent ranks: one message per
node and direction crosses a NIC).

What is not modelled: contention inside the switch (links are full duplex and
the switch non-blocking), and overlap of a rank's receives with its own compute.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..costmodel import CostModel
from ..errors import CommTimeoutError, RankAbortedError
from .base import REDUCERS, Communicator, Handle, check_payload
from .local import wait_for_message
from .topology import Topology, TopologyError

__all__ = [
    "Charge",
    "ChargeFn",
    "SimCommunicator",
    "SimResult",
    "SimWorld",
    "bytes_charge",
    "simulate_ranks",
]

T = TypeVar("T")

_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Charge:
    """What a payload costs at full scale: bytes on the wire, elements to reduce, dense?"""

    nbytes: float
    elements: float
    dense: bool


ChargeFn = Callable[[torch.Tensor, int], Charge]


def bytes_charge(buf: torch.Tensor, scale: int = 1) -> Charge:
    """The default charge: ``scale`` times the payload's bytes, one element per 8 bytes.

    The transport knows nothing of what payloads hold; a caller that does (the
    simulator, which knows the wire format) passes its own ``charge`` function.

    Example:
        >>> bytes_charge(torch.zeros(16, dtype=torch.uint8), scale=4)
        Charge(nbytes=64, elements=8.0, dense=False)
    """
    n = buf.numel()
    return Charge(n * scale, n * scale / 8, False)


class _Turns:
    """Which rank runs: the ready rank of the earliest virtual time (ties: lowest rank).

    Replaces a plain lock, whose hand-over order was the OS's: the node's NIC
    queues (``nic_tx_free``/``nic_rx_free``) are served in the order ranks reach
    them, so that order must be a function of the virtual clocks. Only the rank
    holding the turn changes the ready heap, so every hand-over is deterministic.
    """

    def __init__(self, world_size: int, aborted: threading.Event, poll_s: float) -> None:
        self._lock = threading.Lock()
        self._go = [threading.Event() for _ in range(world_size)]
        self._ready: list[tuple[float, int]] = []
        self._holder: int | None = None
        self._aborted = aborted
        self._poll_s = poll_s
        # box key -> (rank blocked on it, its clock)
        self._waiting: dict[tuple[int, int, int], tuple[int, float]] = {}

    def ready(self, rank: int, key: float) -> None:
        with self._lock:
            heapq.heappush(self._ready, (key, rank))
            self._dispatch()

    def wait_for(self, box: tuple[int, int, int], rank: int, clock: float) -> None:
        """``rank`` (holding the turn) waits for a message into ``box``."""
        with self._lock:
            self._waiting[box] = (rank, clock)

    def deliver(self, box: tuple[int, int, int], ready: float) -> None:
        """A message into ``box`` is ready at ``ready``: its waiting receiver runs again
        at ``max(its clock, ready)``."""
        with self._lock:
            blocked = self._waiting.pop(box, None)
            if blocked is not None:
                heapq.heappush(self._ready, (max(blocked[1], ready), blocked[0]))
                self._dispatch()

    def cancel(self, rank: int) -> None:
        """``rank`` leaves a wait by an exception (a timeout, an abort): nothing may
        wake it later (a late message, a collective's end), or the turn would go to a
        rank that no longer waits for it."""
        with self._lock:
            for box in [b for b, (r, _) in self._waiting.items() if r == rank]:
                del self._waiting[box]
            kept = [entry for entry in self._ready if entry[1] != rank]
            if len(kept) != len(self._ready):
                self._ready = kept
                heapq.heapify(self._ready)

    def _dispatch(self) -> None:
        if self._holder is None and self._ready:
            _, self._holder = heapq.heappop(self._ready)
            self._go[self._holder].set()

    def acquire(self, rank: int) -> None:
        while not self._go[rank].wait(self._poll_s):
            if self._aborted.is_set():  # after a failure: a plain mutex
                with self._lock:
                    if self._holder is None:
                        self._holder = rank
                        break
        self._go[rank].clear()

    def take(self, rank: int) -> None:
        """Take the turn out of order, as a plain mutex (a failing rank on its way out)."""
        while True:
            with self._lock:
                if self._holder in (None, rank):
                    self._holder = rank
                    self._go[rank].clear()
                    return
            self._go[rank].wait(0.01)

    def release(self, rank: int) -> None:
        with self._lock:
            if self._holder == rank:
                self._holder = None
                self._dispatch()

    def yield_at(self, rank: int, key: float) -> None:
        """Let an earlier ready rank run first (call holding the turn)."""
        with self._lock:
            if not self._ready or self._ready[0] >= (key, rank):
                return
        self.ready(rank, key)
        self.release(rank)
        self.acquire(rank)


class SimWorld:
    """Mailboxes, rendezvous slots and the model shared by the ranks of one simulation."""

    def __init__(
        self,
        world_size: int,
        model: CostModel,
        scale: int = 1,
        size: int | None = None,
        compute: str = "model",
        cpu_share: float = 1.0,
        charge: ChargeFn = bytes_charge,
        topology: Topology | None = None,
    ) -> None:
        if topology is not None and topology.world_size != world_size:
            raise TopologyError(
                f"the topology places {topology.world_size} ranks, the simulation has {world_size}"
            )
        if scale < 1:
            raise ValueError(f"scale must be a positive integer, got {scale}")
        if compute not in ("model", "measured"):
            raise ValueError(f"compute must be 'model' or 'measured', got {compute!r}")
        if cpu_share <= 0:
            raise ValueError(f"cpu_share must be positive, got {cpu_share}")
        # "measured": a rank's local work between communication calls is timed for
        # real (one rank runs at a time, on one core) and charged times cpu_share
        # (ranks per core on the machine being predicted); the model's gamma terms
        # for received elements are then dropped, the measurement includes them
        self.measure = compute == "measured"
        self.cpu_share = float(cpu_share)
        self.gamma_scale = 0.0 if self.measure else 1.0
        self.world_size = world_size
        self.charge = charge
        self.model = model
        self.scale = int(scale)
        # elements of the scaled vector; dense-collective payloads of at least
        # size / P elements are data, smaller ones control
        self.size = size
        self.aborted = threading.Event()
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue[Any]] = defaultdict(
            queue.SimpleQueue
        )
        self._cond = threading.Condition()
        self._slots: dict[int, dict[str, Any]] = {}
        # waiting ranks wake up this often to look for an abort; fewer wake-ups with
        # many ranks, or they would keep taking the GIL from the one that runs
        self.poll_s = _POLL_S * max(1.0, world_size / 64)
        # Cooperative scheduling: a rank runs only while it holds the turn and gives
        # it up while it waits for a message or a collective, or when a rank of an
        # earlier virtual time is ready before it uses a NIC. Thousands of threads
        # then never compete for the GIL (whose hand-over after every small tensor
        # op would otherwise cost up to the switch interval), and the NICs serve the
        # ranks in virtual-time order.
        self.turns = _Turns(world_size, self.aborted, self.poll_s)
        # Node topology: messages inside a node cost (alpha_intra, beta_intra) and
        # leave the NIC alone; messages between nodes queue on the sending node's
        # NIC and the receiving node's (shared by the node's ranks). Without one,
        # every rank is its own node with its own NIC (the flat model).
        self.topology = topology
        self.node_of = (
            [topology.node_of(r) for r in range(world_size)]
            if topology is not None
            else list(range(world_size))
        )
        nodes = max(self.node_of) + 1 if world_size else 0
        self.nic_tx_free = [0.0] * nodes
        self.nic_rx_free = [0.0] * nodes
        self.per_node = topology.ranks_per_node if topology is not None else 1

    @property
    def beta_sparse(self) -> float:
        m = self.model
        return m.beta_sparse if m.beta_sparse is not None else m.beta

    def box(self, src: int, dst: int, tag: int) -> queue.SimpleQueue[Any]:
        with self._lock:
            return self._boxes[(src, dst, tag)]

    def is_data(self, numel: int) -> bool:
        if self.size is None:
            return True
        return numel * self.world_size >= self.size

    def rendezvous(
        self,
        rank: int,
        key: int,
        clock: float,
        contribution: Any,
        finish: Callable[[float, list[Any]], list[tuple[float, Any]]],
        timeout: float,
    ) -> tuple[float, Any]:
        """Deposit ``contribution``; the last rank runs ``finish(start, all)`` for everyone.

        ``start`` is the latest arrival clock; ``finish`` returns per rank its
        new clock and its output.
        """
        deadline = time.monotonic() + timeout
        p = self.world_size
        with self._cond:  # deposit while holding the turn: the wake-ups are deterministic
            slot = self._slots.setdefault(key, {"in": [None] * p, "clock": [0.0] * p, "n": 0})
            slot["in"][rank] = contribution
            slot["clock"][rank] = clock
            slot["n"] += 1
            if slot["n"] == p:
                try:
                    slot["out"] = finish(max(slot["clock"]), slot["in"])
                except BaseException as e:  # every rank re-raises it
                    slot["error"] = e
                slot["left"] = p
                for r in range(p):
                    self.turns.ready(r, slot["out"][r][0] if "out" in slot else 0.0)
                self._cond.notify_all()
        self.turns.release(rank)  # let other ranks run while this one waits
        try:
            out = self._await_slot(rank, key, deadline, timeout)
        except BaseException:
            self.turns.cancel(rank)
            self.turns.take(rank)
            raise
        self.turns.acquire(rank)
        return out

    def _await_slot(
        self,
        rank: int,
        key: int,
        deadline: float,
        timeout: float,
    ) -> tuple[float, Any]:
        p = self.world_size
        with self._cond:
            slot = self._slots[key]
            while "out" not in slot and "error" not in slot:
                if self.aborted.is_set():
                    raise RankAbortedError(
                        f"rank {rank}: aborted in a collective because another rank failed"
                    )
                if time.monotonic() > deadline:
                    missing = [r for r in range(p) if slot["in"][r] is None]
                    raise CommTimeoutError(
                        f"rank {rank}: timed out after {timeout:g}s in a collective waiting "
                        f"for rank(s) {missing[:8]}",
                        peer=missing[0] if missing else None,
                    )
                self._cond.wait(self.poll_s)
            slot["left"] -= 1
            if slot["left"] == 0:
                del self._slots[key]
            if "error" in slot:
                raise slot["error"]
            out: tuple[float, Any] = slot["out"][rank]
            return out


class SimCommunicator(Communicator):
    """One rank of a :class:`SimWorld`: real payloads, virtual time.

    Attributes:
        clock: this rank's virtual time in seconds.
        charged_bytes: full-scale bytes this rank sent (what ``stats`` would count
            at full size).
    """

    # the simulator models the transports that agree on failures (gloo and NCCL
    # through their store), so it charges their O(log P) consistency check
    agrees_on_failures = True
    one_process = True

    def __init__(self, world: SimWorld, rank: int, timeout: float = 600.0) -> None:
        super().__init__(rank, world.world_size, timeout)
        self.world = world
        self.device = torch.device("cpu")
        self.clock = 0.0
        self.tx_free = 0.0
        self.rx_free = 0.0
        self.charged_bytes = 0.0
        self.messages = 0
        self.compute_s = 0.0
        self._collectives = 0
        self._mark = time.perf_counter()
        if world.topology is not None:
            self.set_topology(world.topology)

    def _charge_compute(self) -> None:
        """Add the local work done since the last mark (measured mode) to the clock."""
        now = time.perf_counter()
        if self.world.measure and self._mark < now:
            spent = (now - self._mark) * self.world.cpu_share
            self.clock += spent
            self.compute_s += spent
        self._mark = now

    def now(self) -> float:
        """This rank's virtual time (the local work so far charged first)."""
        self._charge_compute()
        return self.clock

    def stop_clock(self) -> None:
        """Charge the local work done so far; what follows is not timed until the next call."""
        self._charge_compute()
        self._mark = math.inf

    def _mark_compute(self) -> None:
        """Start timing local work now (after a wait that was not this rank's work)."""
        self._mark = time.perf_counter()

    def reset_clock(self) -> None:
        """Start a new measured phase: a collective that sets every rank's clock,
        link times and counters to zero (call it on every rank)."""
        p = self.world_size
        w = self.world

        def finish(start: float, _: list[Any]) -> list[tuple[float, Any]]:
            # every NIC at once, before any rank leaves (and could send again)
            w.nic_tx_free[:] = [0.0] * len(w.nic_tx_free)
            w.nic_rx_free[:] = [0.0] * len(w.nic_rx_free)
            return [(0.0, None)] * p

        if p > 1:
            self._collective(None, finish)
        else:
            finish(0.0, [])
        self.clock = self.tx_free = self.rx_free = 0.0
        self.charged_bytes = 0.0
        self.messages = 0
        self.compute_s = 0.0
        self._mark_compute()

    # ------------------------------------------------------------------ p2p
    def _beta(self, c: Charge) -> float:
        return self.world.model.beta if c.dense else self.world.beta_sparse

    def _inside(self, peer: int) -> bool:
        """Whether ``peer`` shares this rank's node (under a topology with nodes)."""
        w = self.world
        return w.topology is not None and w.node_of[peer] == w.node_of[self.rank]

    def _link_beta(self, c: Charge, peer: int) -> float:
        """Seconds per byte to or from ``peer``: inside the node, or through the NIC."""
        return self.world.model.beta_intra if self._inside(peer) else self._beta(c)

    def _pair_beta(self, c: Charge, src: int, dst: int) -> float:
        """Seconds per byte from ``src`` to ``dst`` in a collective where every rank
        sends at once: inside a node ``beta_intra``; between nodes the NIC's
        ``beta`` shared by the node's ranks (``beta`` times the ranks per node)."""
        w = self.world
        if w.topology is None:
            return self._beta(c)
        if w.node_of[src] == w.node_of[dst]:
            return w.model.beta_intra
        return self._beta(c) * w.per_node

    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:
        if self.world.aborted.is_set():
            raise RankAbortedError(f"rank {self.rank}: aborted because another rank failed")
        self._charge_compute()
        w = self.world
        c = w.charge(buf, 1 if self._control else w.scale)
        wire = self._link_beta(c, dst) * c.nbytes
        if self._inside(dst):
            start = max(self.clock, self.tx_free)
            self.tx_free = start + wire
            ready = start + w.model.alpha_intra + wire
            done = self.tx_free
        else:  # the node's NIC, shared by its ranks (a rank's own without a topology)
            if w.per_node > 1:  # a shared NIC: earlier senders take it first
                w.turns.yield_at(self.rank, self.clock)
                self._mark_compute()  # (others' run time is not this rank's work)
            node = w.node_of[self.rank]
            start = max(self.clock, w.nic_tx_free[node])
            w.nic_tx_free[node] = done = start + wire
            ready = start + w.model.alpha + wire
        self.charged_bytes += c.nbytes
        self.messages += 1
        w.box(self.rank, dst, tag).put((buf.to("cpu", copy=True), ready, c, wire))
        w.turns.deliver((self.rank, dst, tag), ready)  # a waiting receiver runs again

        def wait() -> None:
            self._charge_compute()
            self.clock = max(self.clock, done)

        return Handle(wait)

    def _irecv(self, src: int, tag: int) -> Handle:
        box = self.world.box(src, self.rank, tag)

        def wait() -> torch.Tensor:
            self._charge_compute()
            turns = self.world.turns
            try:
                buf, ready, c, wire = box.get_nowait()
            except queue.Empty:
                turns.wait_for((src, self.rank, tag), self.rank, self.clock)
                turns.release(self.rank)
                try:
                    buf, ready, c, wire = wait_for_message(
                        box,
                        self.world.aborted,
                        self.rank,
                        src,
                        tag,
                        self.timeout,
                        self.world.poll_s,
                    )
                except BaseException:
                    turns.cancel(self.rank)  # (a caller may go on: not woken later)
                    turns.take(self.rank)
                    raise
                turns.acquire(self.rank)
            else:
                if self.world.per_node > 1 and not self._inside(src):  # a shared NIC
                    turns.yield_at(self.rank, max(self.clock, ready))
            if self._inside(src):
                arrival = max(ready, self.rx_free + wire)
                self.rx_free = arrival
            else:
                node = self.world.node_of[self.rank]
                arrival = max(ready, self.world.nic_rx_free[node] + wire)
                self.world.nic_rx_free[node] = arrival
            self._mark_compute()
            gamma = self.world.model.gamma_add if c.dense else self.world.model.gamma
            self.clock = max(self.clock, arrival) + self.world.gamma_scale * gamma * c.elements
            return buf

        return Handle(wait)

    # ------------------------------------------------------------------ collectives
    def _collective(
        self, contribution: Any, finish: Callable[[float, list[Any]], list[tuple[float, Any]]]
    ) -> Any:
        if self.world.aborted.is_set():
            raise RankAbortedError(f"rank {self.rank}: aborted because another rank failed")
        self._collectives += 1
        self._charge_compute()
        clock, out = self.world.rendezvous(
            self.rank, self._collectives, self.clock, contribution, finish, self.timeout
        )
        self._mark_compute()
        self.clock = clock
        return out

    def _dense_bytes(self, numel: int, element_size: int) -> float:
        w = self.world
        data = w.is_data(numel) and not self._control
        return float(numel * element_size * (w.scale if data else 1))

    def allreduce(
        self, tensor: torch.Tensor, op: str = "sum", tag: int = 0, *, donate: bool = False
    ) -> torch.Tensor:
        """Dense allreduce from the last arrival, the cheaper of two algorithms
        (``donate`` is accepted and changes nothing here).

        Ring: ``2(P-1) alpha + 2(P-1)/P L beta + (P-1)/P n gamma_dense``; recursive
        doubling: ``ceil(log2 P) (alpha + L beta + n gamma_dense)`` (what an MPI
        library picks for small payloads such as counts and thresholds). Reduced
        once in rank order, so every rank receives the same bits.
        """
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"unknown reduction {op!r}; use sum, max or min")
        flat = tensor.detach().contiguous().reshape(-1).clone()
        p, m = self.world_size, self.world.model
        if p == 1:
            return flat.reshape(tensor.shape)
        nbytes = self._dense_bytes(flat.numel(), flat.element_size())
        elements = nbytes / flat.element_size()
        hops = math.ceil(math.log2(p))
        ring = (
            2 * (p - 1) * m.alpha
            + 2 * (p - 1) / p * nbytes * m.beta
            + (p - 1) / p * elements * m.gamma_add
        )
        doubling = hops * (m.alpha + nbytes * m.beta + elements * m.gamma_add)
        if ring <= doubling:
            cost, sent, messages = ring, 2 * (p - 1) / p * nbytes, 2 * (p - 1)
        else:
            cost, sent, messages = doubling, hops * nbytes, hops
        self.charged_bytes += sent
        self.messages += messages

        def finish(start: float, parts: list[torch.Tensor]) -> list[tuple[float, Any]]:
            if len({t.numel() for t in parts}) != 1:
                raise ValueError("allreduce: tensors of different sizes across ranks")
            acc = parts[0]
            for t in parts[1:]:
                acc = reducer(acc, t)
            return [(start + cost, acc)] * p

        out: torch.Tensor = self._collective(flat, finish)
        return out.clone().reshape(tensor.shape)

    def allgatherv(self, buf: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Allgather of any sizes: ``ceil(log2 P) alpha + beta * (bytes of the others)``.

        (Recursive doubling's latency; every rank receives the others' bytes once.)
        """
        buf = check_payload(buf)
        p, m = self.world_size, self.world.model
        if p == 1:
            return [buf]
        w = self.world
        scale = 1 if self._control else w.scale  # control traffic is not scaled data
        mine = w.charge(buf, scale)
        self.charged_bytes += (p - 1) * mine.nbytes  # each block crosses P-1 links
        self.messages += p - 1

        def finish(start: float, bufs: list[torch.Tensor]) -> list[tuple[float, Any]]:
            charges = [w.charge(b, scale) for b in bufs]
            out = list(bufs)
            ends = []
            for r in range(p):
                # each rank receives the others' blocks once; under a topology those
                # from other nodes come through the NIC its node's ranks share
                wire = math.fsum(
                    c.nbytes * self._pair_beta(c, i, r) for i, c in enumerate(charges) if i != r
                )
                ends.append((start + math.ceil(math.log2(p)) * m.alpha + wire, out))
            return ends

        got: list[torch.Tensor] = self._collective(buf, finish)
        return list(got)

    def allgather(self, tensor: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Dense allgather of equal shapes (a ring, as gloo's): ``ceil(log2 P) alpha +
        (P-1) L beta``, under a topology too (one flow per node and direction crosses
        a NIC: measured, ``dsar_split_allgather``'s dense allgather took as long on
        2 nodes x 4 ranks as on 8 hosts, docs/cluster.md "A core per rank")."""
        flat = tensor.detach().contiguous().reshape(-1).clone()
        p, m = self.world_size, self.world.model
        if p == 1:
            return [flat.reshape(tensor.shape)]
        nbytes = self._dense_bytes(flat.numel(), flat.element_size())
        self.charged_bytes += (p - 1) * nbytes
        self.messages += p - 1

        def finish(start: float, parts: list[torch.Tensor]) -> list[tuple[float, Any]]:
            sizes = {t.numel() for t in parts}
            if len(sizes) != 1:
                raise ValueError(
                    f"allgather: ranks sent {sorted(sizes)} elements (shapes differ across ranks)"
                )
            # the ring's closed form under a topology too: its neighbours are adjacent
            # ranks, so one flow per node and direction crosses a NIC (as allreduce)
            end = start + math.ceil(math.log2(p)) * m.alpha + (p - 1) * nbytes * m.beta
            return [(end, parts)] * p

        parts: list[torch.Tensor] = self._collective(flat, finish)
        return [t.reshape(tensor.shape) for t in parts]

    def alltoallv(self, parts: Sequence[torch.Tensor], tag: int = 0) -> list[torch.Tensor]:
        """Direct personalised all-to-all.

        Rank ``r`` finishes at ``start + (P-1) alpha + max(out_r, in_r) + gamma E_r``:
        its outgoing and incoming links work in parallel (``out_r``/``in_r``: its
        bytes times beta), ``E_r`` the elements it receives (``gamma_add`` for dense
        pieces; no gamma term with measured compute).
        """
        p, me = self.world_size, self.rank
        if len(parts) != p:
            raise ValueError(f"alltoallv needs {p} parts (one per rank), got {len(parts)}")
        mine = [check_payload(t) for t in parts]
        if p == 1:
            return mine
        scale, m = (1 if self._control else self.world.scale), self.world.model
        charges = [
            self.world.charge(t, scale) if j != me else Charge(0, 0, False)
            for j, t in enumerate(mine)
        ]
        self.charged_bytes += sum(c.nbytes for c in charges)
        self.messages += p - 1
        # the receiver's reduction of each piece, as a point-to-point receive charges
        # it (none with measured compute: the reduction runs in the caller's code,
        # and is timed there)
        gamma = self.world.gamma_scale
        contribution = (
            mine,
            [c.nbytes * self._pair_beta(c, me, j) for j, c in enumerate(charges)],
            [gamma * c.elements * (m.gamma_add if c.dense else m.gamma) for c in charges],
        )

        def finish(start: float, rows: list[Any]) -> list[tuple[float, Any]]:
            out = []
            for r in range(p):
                tx = sum(rows[r][1])
                rx = math.fsum(rows[i][1][r] for i in range(p))
                reduce_s = math.fsum(rows[i][2][r] for i in range(p))
                end = start + (p - 1) * m.alpha + max(tx, rx) + reduce_s
                out.append((end, [rows[i][0][r] for i in range(p)]))
            return out

        got: list[torch.Tensor] = self._collective(contribution, finish)
        return got

    def barrier(self) -> None:
        """All ranks leave at the latest arrival plus ``2 log2(P) alpha`` (dissemination)."""
        p, m = self.world_size, self.world.model
        if p == 1:
            return
        hops = math.ceil(math.log2(p))
        self._collective(None, lambda start, _: [(start + 2 * hops * m.alpha, None)] * p)


@dataclasses.dataclass
class SimResult:
    """Per rank: the function's result, virtual finish time, charged bytes and messages."""

    results: list[Any]
    clocks: list[float]
    charged_bytes: list[float]
    messages: list[int]
    wall_s: float
    compute_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def time(self) -> float:
        """The collective's time: the slowest rank's clock."""
        return max(self.clocks) if self.clocks else 0.0


def simulate_ranks(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    model: CostModel | None = None,
    scale: int = 1,
    size: int | None = None,
    timeout: float = 600.0,
    stack_kib: int = 1024,
    compute: str = "model",
    cpu_share: float = 1.0,
    charge: ChargeFn = bytes_charge,
    topology: Topology | None = None,
) -> SimResult:
    """Run ``fn(comm, *args)`` on ``world_size`` simulated ranks under ``model``.

    Args:
        world_size: ranks (threads), at least 1; thousands are fine.
        fn: the SPMD function; its first argument is the rank's :class:`SimCommunicator`.
            Each rank's clock starts at 0; reset ``comm.clock`` (and the link times)
            with :meth:`SimCommunicator.reset_clock` between phases.
        model: alpha, beta(, beta_sparse), gamma (default: the stored calibration).
        scale: the data scale ``s``: ranks hold ``N / s``, messages are charged at ``N``.
        size: the scaled vector length (tells data from control in dense collectives).
        timeout: real seconds a rank waits for a peer before failing.
        stack_kib: thread stack size.
        compute: ``"model"`` charges ``gamma`` per received element; ``"measured"``
            times each rank's local work between communication calls instead.
        cpu_share: with measured compute, its multiplier (ranks sharing one core).
        charge: what a point-to-point payload costs at full scale (default
            :func:`bytes_charge`; the simulator passes one that reads the wire format).
        topology: which ranks share a node (:class:`~sparcml.comm.topology.Topology`):
            messages inside a node cost ``model.alpha_intra``/``beta_intra``, those
            between nodes queue on the nodes' shared NICs at ``alpha``/``beta``; the
            ranks' ``comm.topology`` is set to it. Default: every rank its own node.

    Raises:
        The first exception of any rank (annotated with the rank), as ``run_ranks``.

    Example:
        >>> from sparcml.costmodel import CostModel
        >>> res = simulate_ranks(4, lambda c: c.allreduce(torch.ones(256)),
        ...                      model=CostModel(alpha=1e-6, beta=1e-9, gamma=0.0))
        >>> round(res.time * 1e6, 3)  # recursive doubling: 2 (alpha + 1024 B * beta)
        4.048
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world = SimWorld(
        world_size,
        model if model is not None else CostModel.load(),
        scale,
        size,
        compute=compute,
        cpu_share=cpu_share,
        charge=charge,
        topology=topology,
    )
    comms = [SimCommunicator(world, r, timeout) for r in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def body(r: int) -> None:
        world.turns.acquire(r)
        try:
            comms[r]._mark_compute()
            results[r] = fn(comms[r], *args)
            comms[r]._charge_compute()
        except BaseException as e:
            with lock:
                errors.append((time.monotonic(), r, e))
            world.aborted.set()
        finally:
            world.turns.release(r)
            comms[r].close()

    t0 = time.perf_counter()
    # millions of short-lived tensors and lists at large P: the cyclic collector
    # would rescan them over and over (nothing here makes cycles that matter)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    old = threading.stack_size()
    threading.stack_size(stack_kib * 1024)
    for r in range(world_size):
        world.turns.ready(r, 0.0)
    try:
        threads = [
            threading.Thread(target=body, args=(r,), name=f"sparcml-sim-{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(old)
    for t in threads:
        t.join()
    if gc_was_enabled:
        gc.enable()
    if errors:
        primary = [e for e in errors if not isinstance(e[2], RankAbortedError)] or errors
        _, rank, exc = min(primary, key=lambda e: e[0])
        exc.add_note(f"(raised on simulated rank {rank} of {world_size})")
        raise exc
    return SimResult(
        results=results,
        clocks=[c.clock for c in comms],
        charged_bytes=[c.charged_bytes for c in comms],
        messages=[c.messages for c in comms],
        wall_s=time.perf_counter() - t0,
        compute_s=[c.compute_s for c in comms],
    )
