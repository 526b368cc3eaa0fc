"""Fault injection over spawned gloo ranks: is the rank that failed the one named?

Two campaigns (``sparcml bench-faults``; the test suite runs a few cases of each):

**Kill and stop.** One victim rank is killed (``os._exit``) or frozen
(``SIGSTOP``) after it has sent a chosen number of messages, i.e. somewhere
inside a collective (past the first consistency exchange), during

* ``collective:<algorithm>``: plain ``sparse_allreduce`` calls with that algorithm
  (``collective`` alone: ``ssar_recursive_double``);
* ``ddp:<method>``: DDP training with the sparcml hook (``ddp`` alone: ``topk``);
* ``optimizer``: training through :class:`~sparcml.torch.DistributedOptimizer`.

Every survivor must raise the documented type — :class:`~sparcml.errors.PeerFailedError`
for a killed rank, :class:`~sparcml.errors.CommTimeoutError` for a frozen one (the
README's error table), also through the DDP hook — whose ``peer`` is the victim.
The time to error is the last survivor's error after the victim's fault.

**Mismatches.** Every rank calls ``sparse_allreduce`` once, one rank with one
setting changed (:data:`MISMATCHES`: algorithm, quantizer, quantize mode, index
coding, ``k``, dtype, ``N``) or with its own code raising (``raises``): every rank
must raise :class:`~sparcml.errors.RankMismatchError` (``raises``: the origin its
own error, the others ``PeerFailedError`` naming it), none waiting for its timeout.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MISMATCHES",
    "FaultResult",
    "MismatchResult",
    "fault_worker",
    "mismatch_worker",
    "run_fault",
    "run_mismatch",
]

ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "dense",
              "auto")  # fmt: skip
DDP_METHODS = ("topk", "oktopk", "dense")
SCENARIOS = (
    *(f"collective:{a}" for a in ALGORITHMS),
    *(f"ddp:{m}" for m in DDP_METHODS),
    "optimizer",
)
MODES = ("kill", "stop")
#: the error a survivor must raise for each mode (README, "Errors")
EXPECTED = {"kill": "PeerFailedError", "stop": "CommTimeoutError"}

#: one setting passed differently on one rank: sparse_allreduce's keyword
#: arguments for (the odd rank, the others); ``size`` and ``dtype`` shape the stream
MISMATCHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "algorithm": ({"algorithm": "ssar_split_allgather"}, {"algorithm": "ssar_recursive_double"}),
    "algorithm (dense)": ({"algorithm": "dense"}, {"algorithm": "ssar_split_allgather"}),
    "algorithm (auto)": ({"algorithm": "ssar_split_allgather"}, {"algorithm": "auto"}),
    "quantizer": ({"algorithm": "dsar_split_allgather", "quantizer": "qsgd"},
                  {"algorithm": "dsar_split_allgather"}),
    "quantizer (dense)": ({"algorithm": "dense", "quantizer": "qsgd"}, {"algorithm": "dense"}),
    "quantize mode": ({"algorithm": "dsar_split_allgather", "quantizer": "qsgd", "quantize": "all"},
                      {"algorithm": "dsar_split_allgather", "quantizer": "qsgd"}),
    "index coding": ({"quantizer": "natural", "quantize": "all", "index_coding": "delta"},
                     {"quantizer": "natural", "quantize": "all"}),
    "k": ({"algorithm": "oktopk", "k": 5}, {"algorithm": "oktopk", "k": 4}),
    "dtype": ({"dtype": torch.float64}, {}),
    "N": ({"size": 49}, {}),
}  # fmt: skip
#: the words each case's refusal must carry (the setting it names)
MISMATCH_NAMES = {
    "algorithm": "algorithm", "algorithm (dense)": "algorithm", "algorithm (auto)": "algorithm",
    "quantizer": "quantizer", "quantizer (dense)": "quantizer", "quantize mode": "quantize mode",
    "index coding": "index coding", "k": "k settings", "dtype": "dtypes", "N": "sizes",
}  # fmt: skip


def _arm(comm: Any, victim: int, after: int, mode: str, mark: str) -> None:
    """On the victim: note the time in ``mark``, then die or freeze at the
    ``after``-th message it sends (point-to-point sends and the backend's own dense
    collectives, which the ``dense`` algorithm and method use, count alike)."""
    if comm.rank != victim:
        return
    sent = [0]

    def fault() -> None:
        sent[0] += 1
        if sent[0] > after:
            Path(mark).write_text(repr(time.time()))
            if mode == "kill":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)

    isend, isend_after, allreduce = comm._isend, comm._isend_after, comm.allreduce

    def counted_isend(buf: torch.Tensor, dst: int, tag: int, *args: Any, **kwargs: Any) -> Any:
        fault()
        return isend(buf, dst, tag, *args, **kwargs)

    def counted_isend_after(buf: torch.Tensor, dst: int, tag: int, recv: Any) -> Any:
        fault()  # (one side of an exchange: sendrecv, alltoallv)
        return isend_after(buf, dst, tag, recv)

    def counted_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fault()
        return allreduce(tensor, *args, **kwargs)

    comm._isend = counted_isend
    comm._isend_after = counted_isend_after
    comm.allreduce = counted_allreduce


def _model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _caught(e: BaseException, t0: float) -> dict[str, Any]:
    return {"type": type(e).__name__, "peer": getattr(e, "peer", None), "message": str(e),
            "seconds": time.monotonic() - t0, "at": time.time()}  # fmt: skip


def fault_worker(
    comm: Any, scenario: str, mode: str, victim: int, after: int, mark: str, steps: int = 60
) -> dict[str, Any]:
    """One rank of one fault run; survivors return what they caught."""
    import sparcml.torch as st
    from sparcml import SparseStream, sparse_allreduce

    kind, _, what = scenario.partition(":")
    t0 = time.monotonic()
    try:
        if kind == "collective":
            algorithm = what or "ssar_recursive_double"
            _arm(comm, victim, after, mode, mark)
            for i in range(steps):
                g = torch.Generator().manual_seed(100 * comm.rank + i)
                x = torch.randn(4000, generator=g)
                idx = x.abs().topk(40).indices.sort().values
                sparse_allreduce(SparseStream(idx, x[idx], 4000), comm, algorithm=algorithm)
        else:
            model = _model()
            if kind == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                net: Any = DDP(model, bucket_cap_mb=0.001)
                state = st.register(net, what or "topk", density=0.1, timeout=comm.timeout)
                opt: Any = torch.optim.SGD(net.parameters(), lr=0.1)
            else:
                net = model
                state = st.SparcmlState("topk", density=0.1, comm=comm)
                opt = st.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1), model, state
                )
            _arm(state.comm, victim, after, mode, mark)
            for i in range(steps):
                g = torch.Generator().manual_seed(100 * comm.rank + i)
                x = torch.randn(8, 16, generator=g)
                loss = net(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    except Exception as e:
        return _caught(e, t0)
    return {"type": "no error", "peer": None, "message": "", "seconds": time.monotonic() - t0,
            "at": time.time()}  # fmt: skip


@dataclasses.dataclass
class FaultResult:
    """One run: the victim, and what each survivor raised."""

    scenario: str
    mode: str
    world: int
    victim: int
    after: int
    survivors: dict[int, dict[str, Any]]
    hang: bool = False
    fault_at: float | None = None  # the victim's clock at its fault (time.time())

    @property
    def right(self) -> int:
        """Survivors that raised a documented type naming the victim."""
        return sum(
            1
            for o in self.survivors.values()
            if o is not None
            and o["type"] in ("PeerFailedError", "CommTimeoutError")
            and o["peer"] == self.victim
        )

    @property
    def wrong_rank(self) -> int:
        """Survivors that named another rank (or none)."""
        return sum(1 for o in self.survivors.values() if o is not None
                   and o.get("peer") != self.victim)  # fmt: skip

    @property
    def wrong_type(self) -> int:
        """Survivors whose error is not the mode's documented type."""
        want = EXPECTED[self.mode]
        return sum(1 for o in self.survivors.values() if o is not None and o["type"] != want)

    @property
    def seconds_to_error(self) -> float | None:
        """From the victim's fault to the last survivor's error (one clock: one host)."""
        ats = [o["at"] for o in self.survivors.values() if o is not None and "at" in o]
        if self.fault_at is None or not ats:
            return None
        return max(ats) - self.fault_at

    @property
    def all_right(self) -> bool:
        return not self.hang and self.fault_at is not None and self.right == self.world - 1


def run_fault(
    scenario: str,
    mode: str,
    world: int,
    seed: int,
    timeout: float = 4.0,
    victim: int | None = None,
) -> FaultResult:
    """One run: ``victim`` (default: a random rank) fails after a random number of
    its messages."""
    from ...comm.launch import ProcessFailedError, run_processes

    rng = random.Random(seed)
    chosen = rng.randrange(world)
    victim = chosen if victim is None else victim
    # past the first call's messages, well before the last call's
    after = rng.randrange(world + 1, 6 * world)
    survivors = [r for r in range(world) if r != victim]
    with tempfile.TemporaryDirectory(prefix="sparcml-fault-") as tmp:
        mark = os.path.join(tmp, "fault_at")
        try:
            out = run_processes(
                world, fault_worker, scenario, mode, victim, after, mark,
                timeout=timeout, deadline=6 * timeout + 30, only=survivors,
            )  # fmt: skip
        except ProcessFailedError as e:
            return FaultResult(scenario, mode, world, victim, after, {-1: {"type": str(e)}}, True)
        at = float(Path(mark).read_text()) if os.path.exists(mark) else None
    return FaultResult(
        scenario, mode, world, victim, after, {r: out[r] for r in survivors}, False, at
    )


def mismatch_worker(comm: Any, case: str, odd: int) -> dict[str, Any]:
    """Every rank calls sparse_allreduce once, rank ``odd`` with one setting changed
    (``case`` of :data:`MISMATCHES`, or ``"raises"``: its quantizer raises KeyError)."""
    from sparcml import SparseStream, sparse_allreduce

    kw = dict(MISMATCHES[case][0 if comm.rank == odd else 1]) if case in MISMATCHES else {}
    size, dtype = kw.pop("size", 50), kw.pop("dtype", torch.float32)
    g = torch.Generator().manual_seed(comm.rank)
    stream = SparseStream(torch.tensor([1, 3, 40]), torch.randn(3, generator=g).to(dtype), size)
    if kw.get("algorithm") == "oktopk":
        stream = SparseStream.dense(torch.randn(size, generator=g).to(dtype))
    if case == "raises":
        from sparcml.compress import get

        q = get("qsgd")
        if comm.rank == odd:

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise KeyError("corrupt quantizer table")

            q.quantize = broken  # type: ignore[method-assign]
        kw = {"algorithm": "ssar_split_allgather", "quantizer": q, "quantize": "all"}
    t0 = time.monotonic()
    try:
        sparse_allreduce(stream, comm, **kw)
    except Exception as e:
        return _caught(e, t0)
    return {"type": "no error", "peer": None, "message": "", "seconds": time.monotonic() - t0}


@dataclasses.dataclass
class MismatchResult:
    """One mismatch run: what every rank raised, and how long it took."""

    case: str
    world: int
    odd: int
    ranks: dict[int, dict[str, Any]]
    hang: bool = False

    def is_right(self, rank: int) -> bool:
        o = self.ranks.get(rank)
        if o is None:
            return False
        if self.case != "raises":
            return o["type"] == "RankMismatchError" and MISMATCH_NAMES[self.case] in o["message"]
        if rank == self.odd:
            return o["type"] == "KeyError"
        return o["type"] == "PeerFailedError" and o["peer"] == self.odd

    @property
    def right(self) -> int:
        return sum(self.is_right(r) for r in range(self.world))

    @property
    def seconds(self) -> float:
        return max((o.get("seconds", 0.0) for o in self.ranks.values()), default=0.0)


def run_mismatch(case: str, world: int, timeout: float = 10.0) -> MismatchResult:
    """One mismatch run over ``world`` gloo processes, the last rank odd."""
    from ...comm.launch import ProcessFailedError, run_processes

    odd = world - 1
    try:
        out = run_processes(world, mismatch_worker, case, odd, timeout=timeout,
                            deadline=3 * timeout + 30)  # fmt: skip
    except ProcessFailedError as e:
        return MismatchResult(case, world, odd, {-1: {"type": str(e)}}, True)
    return MismatchResult(case, world, odd, dict(enumerate(out)))
