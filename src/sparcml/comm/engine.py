"""Background engine for non-blocking collectives (paper 000, sec. 7).

Each communicator owns at most one engine: a worker thread that runs submitted
collectives one after another, in submission order. Since every rank submits
its collectives in the same program order, outstanding operations complete in
the same order on every rank, while the submitting thread goes on computing
(communication overlaps computation, as SparCML's non-blocking operations do).

A blocking collective issued while the engine exists is queued behind the
outstanding ones and waited for, so blocking and non-blocking calls keep one
order.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Engine", "Work", "complete_future", "device_future"]


class Work:
    """Handle of a non-blocking collective, shaped like ``torch.distributed``'s Work.

    Example:
        >>> stream = SparseStream(torch.tensor([1]), torch.tensor([2.0]), 4)
        >>> work = sparcml.sparse_allreduce(stream, async_op=True)
        >>> busy = torch.ones(8).sum()  # compute while it runs
        >>> work.wait().to_dense().tolist()
        [0.0, 2.0, 0.0, 0.0]
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            fut = self._future
        if fut is not None:
            complete_future(fut, result, error)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done and return the result (re-raising the operation's error).

        Raises:
            TimeoutError: if ``timeout`` seconds pass first (the operation goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"operation not completed within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` completed with the result (or the error).

        Made on first request, allowed to hold tensors on every visible CUDA device
        (:func:`device_future`)."""
        with self._lock:
            if self._future is None:
                self._future = device_future()
                if self._done.is_set():
                    complete_future(self._future, self._result, self._error)
            return self._future

    def exception(self) -> BaseException | None:
        return self._error


def device_future(device: torch.device | None = None) -> torch.futures.Future[Any]:
    """A ``torch.futures.Future`` that may complete with CUDA tensors.

    A future made without devices accepts CPU tensors only: completing it with a
    CUDA tensor raises, and whoever waits on it (DDP's reducer) waits forever.
    With devices, completion records an event on the completing thread's current
    stream, and each waiter's stream waits for it (PyTorch's CUDA future
    semantics). ``device``: that device alone; default every visible CUDA device
    (none on a machine without CUDA).
    """
    if device is not None:
        devices = [device] if device.type == "cuda" else []
    else:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(n)]
    return torch.futures.Future(devices=devices or None)


def complete_future(
    fut: torch.futures.Future[Any], result: Any, error: BaseException | None
) -> None:
    """Complete ``fut`` with ``result`` or ``error``; a result it cannot hold (a
    tensor on a device it was not made for) completes it with that error instead,
    so that no waiter is left waiting."""
    if error is None:
        try:
            fut.set_result(result)
            return
        except Exception as e:  # handed to the waiter
            error = e
    fut.set_exception(error)


_STOP = object()


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_engines() -> None:
    """Stop every engine thread before the interpreter tears torch down.

    A worker thread still parked at interpreter exit can be killed inside
    torch/gloo code during finalization, which aborts the process
    ("terminate called without an active exception", seen under torchrun).
    """
    for engine in list(_live_engines):
        engine.shutdown(timeout=10.0)  # an operation stuck on a dead peer must not hang exit


class Engine:
    """Runs callables for one communicator on a background thread, in FIFO order."""

    def __init__(self, comm: Any) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # set (under the lock) when shutdown queues the stop marker: a later submit
        # is refused instead of queued behind the marker, where no thread takes it
        self._lock = threading.Lock()
        self._closed = False
        self._record: Callable[[BaseException], None] = getattr(comm, "fail_call", lambda e: None)
        self._thread = threading.Thread(
            target=self._loop, name=f"sparcml-engine-rank{comm.rank}", daemon=True
        )
        self._thread.start()
        _live_engines.add(self)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._fail_leftovers()
                return
            fn, work = item
            try:
                work._finish(result=fn())
            except BaseException as e:
                self._recorded(e)
                work._finish(error=e)

    def _recorded(self, e: BaseException) -> None:
        with contextlib.suppress(Exception):  # reporting must not replace the error
            self._record(e)

    def _fail_leftovers(self) -> None:
        """Fail whatever is still queued after the stop marker (none can be, since
        submit is refused once the marker is queued; kept as a guarantee)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item[1]._finish(error=RuntimeError("the communicator's engine was shut down"))

    def submit(self, fn: Callable[[], Any]) -> Work:
        """Queue ``fn`` behind everything submitted before; returns its :class:`Work`.

        Raises:
            RuntimeError: the engine was shut down (also while an operation still ran).
        """
        with self._lock:
            if self._closed or not self._thread.is_alive():
                raise RuntimeError("the communicator's engine has been shut down")
            work = Work()
            self._queue.put((fn, work))
        return work

    def in_engine_thread(self) -> bool:
        """True when called from this engine's own worker thread."""
        return threading.current_thread() is self._thread

    def run(self, fn: Callable[[], Any], async_op: bool) -> Any:
        """Run ``fn`` in submission order: a ``Work`` if ``async_op``, else its result.

        Called from the engine's own thread (a collective inside a collective), ``fn``
        runs inline, since queueing it behind the caller would deadlock.
        """
        if self.in_engine_thread():
            if async_op:
                work = Work()
                try:
                    work._finish(result=fn())
                except BaseException as e:
                    self._recorded(e)
                    work._finish(error=e)
                return work
            try:
                return fn()
            except BaseException as e:
                self._recorded(e)
                raise
        work = self.submit(fn)
        return work if async_op else work.wait()

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish the queued operations, then stop the thread.

        Args:
            timeout: wait at most this long for the thread (None: until it ends).
        """
        with self._lock:
            stop = not self._closed and self._thread.is_alive()
            self._closed = True
            if stop:
                self._queue.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
