"""``sparse_allreduce``: the front door of the sparse allreduce algorithms.

Every call first gathers a few integers per rank (size, dtype, nnz, the call
number, the caller's ``call_id``, a NaN/Inf flag when quantizing, the call's
settings: :class:`~sparcml.collectives.headers.CallSettings`) on every rank: a
recursive-doubling exchange of 48-byte headers, ``log2 P`` messages per rank
(``P-1`` direct messages on a backend without failure agreement, MPI), or the
same headers inside the algorithm's own first messages once ``auto`` has settled.
That check makes mismatched calls fail with the same clear error on every rank
instead of hanging or corrupting data, and gives ``algorithm="auto"`` the
observed nnz of every rank for the cost model
(:mod:`sparcml.costmodel`). The choice is computed from the same gathered numbers
and the same cost model (its fingerprint is in the header) on every rank, so all
ranks pick the same algorithm.

An explicit ``algorithm=`` whose first round is a message to every peer (the
split phase: registered with ``header_in_first_round``) carries the header in
that round instead (:class:`~sparcml.collectives.codec.FirstRound`): every rank
checks every header before it uses anything received, so the errors are the
same, and the call costs no rounds beyond the algorithm's own. Recursive
doubling (``header_in_rounds``) carries the headers in every round, which are
the exchange's own messages (:class:`~sparcml.collectives.codec.CarriedHeaders`).
``auto`` skips the exchange too once its choice is settled
(:func:`~.autotune.carrying_choice`): when every call so far settled on one such algorithm,
or when the previous call of the same ``N``, value size and codec settled on
recursive doubling; every rank holds the same history, so a mismatched call is
refused on every rank, never hung. (This goes beyond the papers, which assume
matching calls.)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal, overload

from ..comm import Communicator, resolve
from ..comm.abort import is_uniform, mark_uniform
from ..comm.engine import Work
from ..comm.hostmem import device_memory_bytes
from ..comm.topology import local_topology
from ..compress.base import Quantizer
from ..costmodel import CostModel
from ..errors import RankMismatchError
from ..stream import SparseStream
from .autotune import (
    auto_model,
    auto_policy,
    carrying_choice,
    observe,
    plan,
    remember,
    run_auto,
)
from .codec import FirstRound, StreamCodec
from .headers import (
    CallSettings,
    check_consistent,
    check_headers,
    consistency_header,
    state_variant,
    topology_fingerprint,
)
from .registry import algorithm_info, algorithms, check_options, get_algorithm

__all__ = ["check_dense_result", "sparse_allreduce", "staged_on_host"]

log = logging.getLogger("sparcml")


def _run(
    stream: SparseStream,
    comm: Communicator,
    number: int,
    settings: CallSettings,
    model: CostModel | None,
    codec: StreamCodec,
    options: dict[str, Any],
    call_id: int | None = None,
    nonfinite: bool = False,
) -> SparseStream:
    algorithm = settings.algorithm
    codec = codec.with_call(number, comm.rank)
    p = comm.world_size

    def carry(running: str) -> FirstRound:
        how = "first_round" if algorithm_info(running).header_in_first_round else True
        header, refuse = consistency_header(
            stream, codec.sequence, call_id, codec.lossy, nonfinite, carried=how,
            settings=settings, rank=comm.rank,
        )  # fmt: skip
        codec.first_round = FirstRound(header, refuse, check_headers)
        return codec.first_round

    if algorithm != "auto":
        info = algorithm_info(algorithm)
        if (info.header_in_first_round or info.header_in_rounds) and p > 1:
            # the header travels in the algorithm's own messages and is checked
            # before anything received is used: no rounds of its own
            carry(algorithm)
        else:
            check_consistent(
                stream, comm, sequence=codec.sequence, call_id=call_id, lossy=codec.lossy,
                nonfinite=nonfinite, settings=settings,
            )  # fmt: skip
        return info.fn(stream, comm, codec, **options)
    isize = stream.values.element_size()
    key = (stream.size, isize, codec.lossy)
    settled = carrying_choice(comm, key) if p > 1 else None
    if settled is not None:
        # run the settled algorithm with the headers in its own messages, and settle
        # the next call on the nnz they bring
        first = carry(settled)
        log.debug("sparse_allreduce auto: %s, headers in its own messages", settled)
        t0 = comm.now()
        out = get_algorithm(settled)(stream, comm, codec)
        assert first.ks is not None
        observe(comm, stream.size, first.ks, isize, codec.lossy, settled, comm.now() - t0)
        # what the next call like this one runs without measuring (None: not settled)
        planned = plan(comm, stream.size, first.ks, isize, codec.lossy, model, create=False)
        remember(comm, key, planned[0])
    else:
        ks = check_consistent(
            stream, comm, sequence=codec.sequence, call_id=call_id, lossy=codec.lossy,
            nonfinite=nonfinite, settings=settings,
        )  # fmt: skip

        def run(name: str) -> SparseStream:
            return get_algorithm(name)(stream, comm, codec)

        planned = plan(comm, stream.size, ks, isize, codec.lossy, model, create=True)
        t0 = comm.now()
        out = run_auto(comm, planned, run)
        again = planned[0] is not None and observe(
            comm, stream.size, ks, isize, codec.lossy, planned[0], comm.now() - t0
        )
        # the plan's algorithm, or the class's winner once its last round decided it
        # (None while the class is measured, again or for the first time)
        settles = None if again else planned[0] or (planned[1].winner if planned[1] else None)
        remember(comm, key, settles)
    assert isinstance(out, SparseStream)
    return out


@overload
def sparse_allreduce(
    stream: SparseStream,
    comm: Communicator | None = ...,
    algorithm: str = ...,
    async_op: Literal[False] = ...,
    *,
    quantizer: Quantizer | str | None = ...,
    quantize: str = ...,
    index_coding: str = ...,
    cost_model: CostModel | None = ...,
    call_id: int | None = ...,
    nonfinite: bool = ...,
    **options: Any,
) -> SparseStream: ...


@overload
def sparse_allreduce(
    stream: SparseStream,
    comm: Communicator | None = ...,
    algorithm: str = ...,
    async_op: Literal[True] = ...,
    *,
    quantizer: Quantizer | str | None = ...,
    quantize: str = ...,
    index_coding: str = ...,
    cost_model: CostModel | None = ...,
    call_id: int | None = ...,
    nonfinite: bool = ...,
    **options: Any,
) -> Work: ...


def sparse_allreduce(
    stream: SparseStream,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
    *,
    quantizer: Quantizer | str | None = None,
    quantize: str = "dense",
    index_coding: str = "auto",
    cost_model: CostModel | None = None,
    call_id: int | None = None,
    nonfinite: bool = False,
    **options: Any,
) -> SparseStream | Work:
    """Sum of every rank's sparse stream, bitwise identical on every rank.

    Args:
        stream: this rank's :class:`SparseStream` (same size and dtype on every rank;
            nnz may differ, zero included).
        comm: the communicator; default the initialised default process group,
            or a world of one rank when torch.distributed is not initialised.
        algorithm: a registered algorithm (``ssar_recursive_double``,
            ``ssar_split_allgather``, ``dsar_split_allgather``, ``dense``, ...) or
            ``"auto"``: the fastest for the observed nnz: under the cost model
            when one is given or calibrated, else measured on the first calls of
            each size/density class (:mod:`sparcml.collectives.autotune`).
        async_op: return a :class:`~sparcml.comm.engine.Work` at once; the operation runs
            on the communicator's background engine, in submission order.
        quantizer: a value quantizer (``sparcml.compress.get("qsgd", bits=4)`` or a
            name such as ``"qsgd"``) for the messages' values; see
            :mod:`sparcml.collectives.codec`. Every rank dequantizes the same bytes,
            so results stay bitwise identical.
        quantize: ``"dense"`` (SparCML sec. 6: only messages carrying dense streams,
            e.g. DSAR's second phase), ``"contributions"`` (SparCML's Alg. 1: each
            rank's own stream quantized once, partial sums exact; the error does not
            depend on the algorithm) or ``"all"`` (every message, partial sums
            re-quantized at each stage). See :mod:`sparcml.collectives.codec`.
        index_coding: how indices travel, lossless whatever it is (results are
            unchanged): ``"auto"`` (default) codes the indices of messages of CPU
            streams (exact and quantized) Elias--Fano where that is smaller than
            sec. 5.1's ``c``-byte fields (9 bits an index instead of 24 at
            ``N = 2^24`` and 0.78% density; :mod:`sparcml.indexcode`); ``"fixed"``
            keeps the ``c``-byte fields everywhere; ``"elias-fano"`` is ``"auto"`` on
            every device; ``"delta"`` is ``"auto"`` and sends the indices of
            quantized sparse messages on other devices as varints of their gaps.
        cost_model: the model ``auto`` decides with (default: the stored calibration;
            without one, ``auto`` measures the candidates on first use).
        call_id: your own number for this call (e.g. the training step), compared
            across ranks: a rank that skipped a call and made an extra one later
            fails on every rank instead of mixing two calls' data (the call counts
            alone are equal then).
        nonfinite: ``True`` when the data this rank's ``stream`` stands for holds
            NaN/Inf (say the gradient a top-k selection was taken from, which the
            selection may drop): carried in the call's consistency header, so that
            every rank raises :class:`~sparcml.errors.NonFiniteError`, naming the
            flagged ranks, before any received data is used, at no extra message
            (beyond the papers, like the whole check).
        **options: algorithm-specific options, e.g. ``k=`` and ``state=`` for
            ``oktopk`` and ``k=`` for ``gaussiank`` (whose input is the accumulator).

    Returns:
        The sum as a :class:`SparseStream` (or a ``Work`` whose ``wait()`` returns it).

    Raises:
        ValueError: unknown algorithm.
        RankMismatchError: ranks passed different sizes or dtypes, or are in
            different calls (call numbers or ``call_id`` differ); raised on all ranks.
        NonFiniteError: a quantizer is set and some rank's values hold NaN/Inf, or
            some rank passed ``nonfinite=True`` (raised on all ranks, naming them).
        CommTimeoutError / PeerFailedError: a peer did not answer or died (names it).

    Example:
        >>> s = SparseStream(torch.tensor([1, 4]), torch.tensor([1.0, 2.0]), 8)
        >>> sparse_allreduce(s).to_dense().tolist()  # a world of one rank
        [0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    """
    comm = resolve(comm)
    given = CallSettings.of(algorithm, quantizer, quantize, index_coding, options)

    def call() -> SparseStream:
        number = comm.next_sequence()
        with comm.in_call(number):
            if not isinstance(stream, SparseStream):
                raise TypeError(
                    f"sparse_allreduce expects a SparseStream, got {type(stream).__name__}; "
                    "wrap a tensor with SparseStream.from_dense(t) or "
                    "SparseStream(indices, values, N)"
                )
            settings = _with_topology(given, comm)
            model = cost_model
            try:
                # what else decides the messages, read when the call runs (an Ok-Topk
                # state's call count moves as earlier calls on the engine finish)
                variant = state_variant(options.get("state"))
                if algorithm == "auto" and comm.world_size > 1:
                    # (the model auto decides with, loaded once for the call)
                    model = auto_model(cost_model)
                    variant = auto_policy(model)
                settings = dataclasses.replace(settings, variant=variant)
                codec = _checked_codec(algorithm, quantizer, quantize, index_coding, options)
            except (ValueError, TypeError) as e:
                # Compare the settings first, this rank's marked refused. A setting
                # that differs between ranks is refused alike on every rank
                # (RankMismatchError, naming it). Where only the refusal differs (the
                # others' settings are valid, and this rank's invalid one is not in the
                # header: an unknown option, or a mode or coding without a quantizer),
                # the others raise RankMismatchError naming this rank, and this rank its
                # own error, with that mismatch's uniformity (whether the others must
                # be told). An invalid setting every rank passed raises this error on
                # each, before any data moves.
                if comm.world_size > 1:
                    refused = dataclasses.replace(settings, refused=True)
                    try:
                        check_consistent(stream, comm, sequence=number, call_id=call_id,
                                         settings=refused)  # fmt: skip
                    except RankMismatchError as mismatch:
                        if getattr(mismatch, "refused", None) is None:
                            raise
                        raise mark_uniform(e, is_uniform(mismatch)) from None
                raise mark_uniform(e, True) from None
            staged = stream if "state" in options else staged_on_host(stream, comm)
            if algorithm != "auto" and _returns_dense(algorithm, options):
                check_dense_result(stream, algorithm, inner=options.get("inner"))
                if staged is not stream:  # (built in host memory first)
                    check_dense_result(staged, algorithm, inner=options.get("inner"))
            out = _run(staged, comm, number, settings, model, codec, options, call_id, nonfinite)
            return out if staged is stream else out.to(stream.device)

    return comm.run_ordered(call, async_op)


def staged_on_host(stream: SparseStream, comm: Communicator) -> SparseStream:
    """The stream a call runs on: a host copy of a GPU stream where the communicator
    moves its bytes through host memory (gloo, MPI, in-process and simulated ranks:
    ``comm.device`` is the CPU), else ``stream`` itself.

    Every message of such a call is copied to the host to be sent and arrives in
    host memory. Encoding, checking, merging and decoding on the GPU then cost a
    device synchronisation each time a size or a check comes back to the host
    (about ten a recursive-doubling call), and dozens of small kernel launches; on
    the host the compiled CPU kernels do the same work on the bytes where they are,
    and the call costs one copy each way (``benchmarks/gpu_syncs.py``; docs/benchmarks.md,
    "On a GPU"). Beyond the papers, which leave the device to the transport (NCCL's
    communicator, on the GPU, runs on the GPU). The results are the same on every
    rank either way: each rank's copy is exact; quantizers then draw from generators
    on the host.

    Only ``sparse_allreduce`` stages, and not a call with a ``state=`` (Ok-Topk's,
    whose state keeps indices on the caller's device); ``oktopk_allreduce``,
    ``reduce_scatter``, ``sparse_allgather`` and RedSync's packed allgather run on
    the stream's device."""
    if comm.world_size > 1 and comm.device.type == "cpu" and stream.device.type != "cpu":
        return stream.to("cpu")
    return stream


def _with_topology(settings: CallSettings, comm: Communicator) -> CallSettings:
    """``settings`` with the fingerprint of the node topology the call may use
    (``auto`` and the two-level and node-aware algorithms; on more than one rank),
    so that ranks that disagree on their nodes are refused alike (beyond the papers).
    Only a layout known without messages is fingerprinted: finding one by gathering
    the node keys is a collective, which must not run before the header has shown
    that every rank is in the same call (a layout to be gathered has a fingerprint
    of its own, the same on every rank)."""
    name = settings.algorithm
    if comm.world_size == 1 or (name != "auto" and name not in algorithms()):
        return settings
    if name != "auto" and not (algorithm_info(name).two_level or algorithm_info(name).node_aware):
        return settings
    # a layout found without messages is kept (comm.topology finds it the same way),
    # so later calls read it back instead of looking again
    found = comm.topology if local_topology(comm) is not None else None
    return dataclasses.replace(settings, topology=topology_fingerprint(found))


def _returns_dense(algorithm: str, options: dict[str, Any]) -> bool:
    """The algorithm's ``dense_result`` fact, or for a two-level algorithm with
    ``inner=`` the inner algorithm's (an unknown inner is refused later, by name)."""
    info = algorithm_info(algorithm)
    inner = options.get("inner")
    if info.two_level and isinstance(inner, str) and inner in algorithms():
        return algorithm_info(inner).dense_result
    return info.dense_result


def _checked_codec(
    algorithm: str,
    quantizer: Quantizer | str | None,
    quantize: str,
    index_coding: str,
    options: dict[str, Any],
) -> StreamCodec:
    """The call's codec, once its settings are valid (else ValueError / TypeError)."""
    if algorithm != "auto":
        check_options(get_algorithm(algorithm), algorithm, options)
    elif options:
        raise ValueError(f"algorithm='auto' takes no options, got {sorted(options)}")
    if isinstance(quantizer, str):
        from ..compress import get

        quantizer = get(quantizer)  # type: ignore[assignment]
    codec = StreamCodec(quantizer, quantize, index_coding=index_coding)  # type: ignore[arg-type]
    if codec.lossy and (algorithm == "dense" or options.get("inner") == "dense"):
        where = "the dense algorithm" if algorithm == "dense" else f"{algorithm}(inner='dense')"
        raise ValueError(
            f"{where} cannot quantize; use algorithm='dsar_split_allgather' (SparCML "
            "sec. 6 quantizes its dense phase), inner='dsar_split_allgather', or no "
            "quantizer"
        )
    return codec


def check_dense_result(stream: SparseStream, algorithm: str, inner: str | None = None) -> None:
    """Refuse, before any message, a dense result that cannot exist on this device
    (``algorithm``'s, or a two-level algorithm's with ``inner=`` such an algorithm).

    Raises:
        ValueError: ``N`` values of the stream's dtype exceed the device's memory
            (physical memory on the CPU, the GPU's total memory on CUDA).
    """
    need = stream.size * stream.values.element_size()
    have = device_memory_bytes(stream.device)
    if have is not None and need > have:
        raise ValueError(
            f"algorithm {algorithm!r}{'' if inner is None else f' with inner={inner!r}'} "
            f"returns a dense result: N = {stream.size:,} "
            f"{str(stream.dtype).removeprefix('torch.')} values need {need:,} bytes, more than "
            f"the {have:,} bytes of memory of {stream.device}; use a sparse algorithm "
            "('ssar_recursive_double', 'ssar_split_allgather') or 'auto'"
        )
