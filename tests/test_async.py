"""Non-blocking sparse allreduce: work handles, futures, ordering, errors."""

from __future__ import annotations

import pytest
import torch

from inputs import dense_reference, make_stream
from sparcml import SparseStream, sparse_allgather, sparse_allreduce
from sparcml.comm import run_ranks
from sparcml.errors import RankMismatchError


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_outstanding_operations_complete_in_order_with_correct_results(world: int) -> None:
    algos = ["ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "auto"]

    def fn(comm):  # type: ignore[no-untyped-def]
        inputs = [
            make_stream("overlap", comm.rank, world, 300 + i, seed=i) for i in range(len(algos))
        ]
        works = [
            sparse_allreduce(s, comm, algorithm=a, async_op=True)
            for s, a in zip(inputs, algos, strict=True)
        ]
        # computation overlapping the communication
        busy = torch.randn(200, 200) @ torch.randn(200, 200)
        blocking = sparse_allreduce(inputs[0], comm, algorithm="dense")  # queued behind them
        futures = [w.get_future() for w in works]
        results = [w.wait(timeout=30) for w in works]
        assert all(w.is_completed() for w in works)
        assert all(f.wait().equal(r) for f, r in zip(futures, results, strict=True))
        return inputs, results, blocking, float(busy.sum())

    out = run_ranks(world, fn)
    for i in range(len(algos)):
        ref = dense_reference([o[0][i] for o in out])
        for o in out:
            assert torch.equal(o[1][i].to_dense().double(), ref)
            assert o[1][i].equal(out[0][1][i])
    ref0 = dense_reference([o[0][0] for o in out])
    assert all(torch.equal(o[2].to_dense().double(), ref0) for o in out)


def test_error_is_raised_by_wait_and_future() -> None:
    def fn(comm):  # type: ignore[no-untyped-def]
        work = sparse_allreduce(SparseStream.empty(10 + comm.rank), comm, async_op=True)
        with pytest.raises(RankMismatchError):
            work.wait()
        assert isinstance(work.exception(), RankMismatchError)
        with pytest.raises(RankMismatchError):
            work.get_future().wait()
        return True

    assert run_ranks(2, fn) == [True, True]


def test_wait_timeout_leaves_operation_running() -> None:
    import threading

    timed_out = threading.Event()  # rank 1 joins only after rank 0's wait gave up

    def fn(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 1:
            assert timed_out.wait(timeout=60)
        work = sparse_allreduce(SparseStream.empty(4), comm, async_op=True)
        if comm.rank == 0:
            with pytest.raises(TimeoutError):
                work.wait(timeout=0.05)
            timed_out.set()
        return work.wait(timeout=30).nnz

    assert run_ranks(2, fn) == [0, 0]


def test_async_allgather_and_split_allgather_inside_the_engine() -> None:
    # ssar_split_allgather gathers internally: run on the engine, it must not deadlock
    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, comm.world_size, 64)
        w1 = sparse_allgather(s, comm, async_op=True)
        w2 = sparse_allreduce(s, comm, algorithm="ssar_split_allgather", async_op=True)
        gathered = w1.wait(timeout=30)
        blocking = sparse_allgather(s, comm)
        return s, gathered, w2.wait(timeout=30), blocking

    out = run_ranks(3, fn)
    ref = dense_reference([o[0] for o in out])
    for _, gathered, reduced, blocking in out:
        assert all(g.equal(o[0]) for g, o in zip(gathered, out, strict=True))
        assert all(g.equal(o[0]) for g, o in zip(blocking, out, strict=True))
        assert torch.equal(reduced.to_dense().double(), ref)


def test_engines_stop_at_interpreter_exit() -> None:
    import subprocess
    import sys

    # atexit runs handlers last-registered first: this check, registered before
    # sparcml is imported, runs after sparcml's own handler has stopped the engines
    code = (
        "import atexit, threading\n"
        "def check():\n"
        "    names = [t.name for t in threading.enumerate() if t.is_alive()]\n"
        "    print('engines alive', sum(n.startswith('sparcml-engine') for n in names))\n"
        "atexit.register(check)\n"
        "import torch, sparcml\n"
        "s = sparcml.SparseStream(torch.tensor([1]), torch.ones(1), 4)\n"
        "sparcml.sparse_allreduce(s, async_op=True).wait()\n"
        "print('engines started', sum(t.name.startswith('sparcml-engine') "
        "for t in threading.enumerate()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "engines started 1" in out.stdout and "engines alive 0" in out.stdout, out.stdout


def test_a_submit_racing_a_shutdown_is_refused_not_lost() -> None:
    """close() while an operation runs, then a submit from another thread: the submit
    used to queue behind the stop marker, and its Work never completed."""
    import threading
    import time

    from sparcml.comm import SelfCommunicator

    comm = SelfCommunicator()
    running = comm.engine.submit(lambda: time.sleep(0.5) or "done")
    closer = threading.Thread(target=comm.engine.shutdown)
    closer.start()
    time.sleep(0.1)  # the stop marker is queued behind the running operation
    with pytest.raises(RuntimeError, match="shut down"):
        comm.engine.submit(lambda: "late")
    closer.join(5)
    assert running.wait(5) == "done"


def test_oktopk_allreduce_keeps_its_place_behind_queued_async_calls() -> None:
    """An Ok-Topk call made while a sparse_allreduce is queued on the engine ran on the
    caller's thread at once: the ranks' calls paired up differently and failed."""
    from sparcml import oktopk_allreduce

    def fn(comm):  # type: ignore[no-untyped-def]
        s = make_stream("random", comm.rank, comm.world_size, 4001)
        works = [sparse_allreduce(s, comm, async_op=True) for _ in range(3)]
        acc = torch.randn(4001, generator=torch.Generator().manual_seed(comm.rank))
        res = oktopk_allreduce(acc, 40, comm)
        return [w.wait().to_dense() for w in works], res.stream.to_dense()

    out = run_ranks(2, fn)
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0], strict=True))
    assert torch.equal(out[0][1], out[1][1])


def test_a_wrong_argument_to_sparse_allgather_leaves_the_communicator_usable() -> None:
    from sparcml.comm import SelfCommunicator

    comm = SelfCommunicator()
    with pytest.raises(TypeError, match="sparse_allgather expects a SparseStream, got Tensor"):
        sparse_allgather(torch.ones(3), comm)  # type: ignore[arg-type]
    s = SparseStream(torch.tensor([1]), torch.ones(1), 4)
    assert sparse_allreduce(s, comm).to_dense().tolist() == [0.0, 1.0, 0.0, 0.0]
