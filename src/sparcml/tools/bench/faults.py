"""Fault injection over spawned gloo ranks: is the rank that failed the one named?

One victim rank is killed (``os._exit``) or frozen (``SIGSTOP``) after it has
sent a chosen number of messages, i.e. somewhere inside a collective (past the
consistency exchange, inside the algorithm), during

* ``collective``: plain ``sparse_allreduce`` calls (``ssar_recursive_double``);
* ``ddp``: DDP training with the sparcml hook (``topk``);
* ``optimizer``: training through :class:`~sparcml.torch.DistributedOptimizer`.

Every survivor must raise :class:`~sparcml.errors.PeerFailedError` or
:class:`~sparcml.errors.CommTimeoutError` (the documented types, also through
the DDP hook) whose ``peer`` is the victim. ``sparcml bench-faults`` runs the
statistics; the test suite runs one or two cases of each.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from typing import Any

import torch

__all__ = ["FaultResult", "fault_worker", "run_fault"]

SCENARIOS = ("collective", "ddp", "optimizer")
MODES = ("kill", "stop")


def _arm(comm: Any, victim: int, after: int, mode: str) -> None:
    """On the victim: die or freeze at the ``after``-th message it sends."""
    if comm.rank != victim:
        return
    original = comm._isend
    sent = [0]

    def isend(buf: torch.Tensor, dst: int, tag: int) -> Any:
        sent[0] += 1
        if sent[0] > after:
            if mode == "kill":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(buf, dst, tag)

    comm._isend = isend


def _model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def fault_worker(
    comm: Any, scenario: str, mode: str, victim: int, after: int, steps: int = 20
) -> dict[str, Any]:
    """One rank of one fault run; survivors return what they caught."""
    import sparcml.torch as st
    from sparcml import SparseStream, sparse_allreduce
    from sparcml.errors import CommError

    t0 = time.monotonic()
    try:
        if scenario == "collective":
            _arm(comm, victim, after, mode)
            for i in range(steps):
                g = torch.Generator().manual_seed(100 * comm.rank + i)
                x = torch.randn(4000, generator=g)
                idx = x.abs().topk(40).indices.sort().values
                sparse_allreduce(
                    SparseStream(idx, x[idx], 4000), comm, algorithm="ssar_recursive_double"
                )
        else:
            model = _model()
            if scenario == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                net: Any = DDP(model, bucket_cap_mb=0.001)
                state = st.register(net, "topk", density=0.1, timeout=comm.timeout)
                opt: Any = torch.optim.SGD(net.parameters(), lr=0.1)
            else:
                net = model
                state = st.SparcmlState("topk", density=0.1, comm=comm)
                opt = st.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1), model, state
                )
            _arm(state.comm, victim, after, mode)
            for i in range(steps):
                g = torch.Generator().manual_seed(100 * comm.rank + i)
                x = torch.randn(8, 16, generator=g)
                loss = net(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    except CommError as e:
        return {"type": type(e).__name__, "peer": e.peer, "message": str(e),
                "seconds": time.monotonic() - t0}  # fmt: skip
    except Exception as e:
        return {"type": type(e).__name__, "peer": None, "message": str(e),
                "seconds": time.monotonic() - t0}  # fmt: skip
    return {"type": "no error", "peer": None, "message": "", "seconds": time.monotonic() - t0}


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
    def all_right(self) -> bool:
        return not self.hang and self.right == self.world - 1


def run_fault(scenario: str, mode: str, world: int, seed: int, timeout: float = 4.0) -> FaultResult:
    """One run: a random victim fails after a random number of its messages."""
    from ...comm.launch import ProcessFailedError, run_processes

    rng = random.Random(seed)
    victim = rng.randrange(world)
    after = rng.randrange(world + 1, 12 * world)  # past the first consistency exchange
    survivors = [r for r in range(world) if r != victim]
    try:
        out = run_processes(
            world, fault_worker, scenario, mode, victim, after,
            timeout=timeout, deadline=6 * timeout + 30, only=survivors,
        )  # fmt: skip
    except ProcessFailedError as e:
        return FaultResult(scenario, mode, world, victim, after, {-1: {"type": str(e)}}, True)
    return FaultResult(
        scenario, mode, world, victim, after, {r: out[r] for r in survivors}, hang=False
    )
