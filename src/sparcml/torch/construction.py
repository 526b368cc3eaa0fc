"""Every rank's verdict on its state's arguments, before the state's process group.

A :class:`~sparcml.torch.SparcmlState` on torch.distributed creates a process
group of its own (``new_group``, a collective). A rank whose arguments are refused
(an unknown method, ``density=0``: a per-rank config gone wrong) raises before it,
and the others would wait in ``new_group`` for their whole timeout, then get
torch's ``DistStoreError``, which names no rank. So every rank first checks in
through the rendezvous store (beyond the papers, like every consistency check):

1. a rank that refuses its arguments notes its error (:func:`note_refusal`) and
   raises it;
2. a rank that accepts them counts itself in and waits until every rank has done
   one or the other: any refusal raises
   :class:`~sparcml.errors.RankMismatchError` naming the refusing ranks and quoting
   their errors; when all accepted, the group is created
   (:func:`checked_in_group`);
3. ranks that never check in (another program, a rank that died) are named when
   the wait times out (:class:`~sparcml.errors.CommTimeoutError`).

States are numbered per process in the order they are built, the same on every
rank of a symmetric program; PyTorch's ``(state, hook)`` pair refuses its arguments
when it is made and builds (checks in) at its first bucket, under the same number.
Without a rendezvous store the group is created directly.

Cost: a key and a counter update per rank, and a poll of two counters (backing off
from 1 to 50 ms) until the last rank arrives, once per state. A rank that times
out marks itself refused, so that a late rank does not go on into ``new_group``
alone. Keys are scoped to torchrun's run and restart (its store outlives a
restart, the counters do not).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ..comm import TorchDistCommunicator
from ..errors import CommTimeoutError, PeerFailedError, RankMismatchError

__all__ = ["checked_in_group", "note_refusal", "noting_refusal"]

#: the number of the next state this process builds or refuses
_builds = itertools.count()


def _store() -> Any:
    """The default process group's rendezvous store, or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # (a backend without one)
        return None


def _key(n: int, what: str | int) -> str:
    # torchrun's agent store outlives a restart of the workers, whose counters start
    # again at 0: the run and the restart name the attempt
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"sparcml/state/{run}/{attempt}/{n}/{what}"


def note_refusal(error: BaseException) -> None:
    """Step 1: note that this rank refused the arguments of the state it was to build
    next (best effort: without a process group or store nothing is noted)."""
    store = _store()
    if store is None:
        return
    n = next(_builds)
    with contextlib.suppress(Exception):
        store.set(_key(n, dist.get_rank()), f"refused {type(error).__name__}: {error}")
        store.add(_key(n, "refused"), 1)


@contextlib.contextmanager
def noting_refusal(noting: bool = True) -> Iterator[None]:
    """Step 1 around a rank's own checks of a state's arguments: an error raised
    inside is noted as this rank's refusal (where ``noting``: the state is to be
    built on the default group, not on a communicator of its own), then raised."""
    try:
        yield
    except Exception as e:
        if noting:
            note_refusal(e)
        raise


def _refusals(store: Any, n: int, world: int) -> tuple[dict[int, str], dict[int, str]]:
    """The ranks that refused their arguments (with their errors), and those that gave
    up waiting (with the ranks they waited for)."""
    refused, gave_up = {}, {}
    for r in range(world):
        if store.check([_key(n, r)]):
            said = bytes(store.get(_key(n, r))).decode("utf-8", "replace")
            if said.startswith("refused "):
                refused[r] = said.removeprefix("refused ")
            elif said.startswith("gave up "):
                gave_up[r] = said.removeprefix("gave up ")
    return refused, gave_up


def checked_in_group(timeout: float) -> TorchDistCommunicator:
    """Steps 2-3, then the state's own process group (a collective every rank of the
    default group reaches).

    Raises:
        RankMismatchError: some rank refused its arguments (named, with its error).
        CommTimeoutError: some rank neither built nor refused its state within
            ``timeout`` seconds (named).
        PeerFailedError: the rendezvous store stopped answering (the process
            holding it exited).
    """
    store, world = _store(), dist.get_world_size()
    n = next(_builds)
    if store is not None and world > 1:
        try:
            _check_in(store, n, world, timeout)
        except (RankMismatchError, CommTimeoutError):
            raise
        except Exception as e:  # the store itself failed (its host exited?)
            raise PeerFailedError(
                f"rank {dist.get_rank()}: the rendezvous store stopped answering while the "
                f"ranks checked in to build their SparcmlState (did the process holding it "
                f"exit?): {e}"
            ) from e
    return TorchDistCommunicator.dedicated(timeout=timeout)


def _first_absent(gave_up: dict[int, str]) -> int | None:
    """The lowest rank some rank gave up waiting for (their notes: ``[2, 3]``)."""
    absent = {int(r) for t in gave_up.values() for r in t.strip("[]").split(",") if r.strip()}
    return min(absent) if absent else None


def _check_in(store: Any, n: int, world: int, timeout: float) -> None:
    """Steps 2-3 for this process's ``n``-th state."""
    me = dist.get_rank()
    store.set(_key(n, me), "built")
    store.add(_key(n, "built"), 1)
    deadline, pause = time.monotonic() + timeout, 0.001
    while True:
        if store.add(_key(n, "refused"), 0):
            refused, gave_up = _refusals(store, n, world)
            if refused:
                detail = "; ".join(f"rank {r}: {t}" for r, t in sorted(refused.items()))
                raise RankMismatchError(
                    f"rank(s) {sorted(refused)} could not build their SparcmlState "
                    f"({detail}): every rank must build it with the same, valid method "
                    "and hyperparameters"
                )
            detail = "; ".join(f"rank {r} for {t}" for r, t in sorted(gave_up.items()))
            raise CommTimeoutError(
                f"rank {me}: rank(s) {sorted(gave_up)} timed out waiting for ranks to "
                f"build their SparcmlState ({detail}; is every rank running the same "
                "program?)",
                peer=_first_absent(gave_up),
            )
        if store.add(_key(n, "built"), 0) >= world:
            break
        if time.monotonic() > deadline:
            absent = [r for r in range(world) if not store.check([_key(n, r)])]
            # a rank arriving later must not count this one in and wait in new_group
            with contextlib.suppress(Exception):
                store.set(_key(n, me), f"gave up {absent}")
                store.add(_key(n, "refused"), 1)
            raise CommTimeoutError(
                f"rank {me}: timed out after {timeout:g}s waiting for rank(s) {absent} "
                "to build their SparcmlState (is every rank running the same program?)",
                peer=absent[0] if absent else None,
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
