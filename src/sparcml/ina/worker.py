"""The worker side: an allreduce through the aggregator, with loss recovery.

Per call (paper 004 App. A, SwitchML's worker protocol):

1. encode: ``NATURAL`` — natural compression to appendix A's 8-bit codes (sign,
   zero flag, exponent offset above ``2^e_min``), offsets clipped to
   ``62 - ceil(log2 P)`` so the aggregator's int64 sums cannot overflow;
   ``FIXED`` — ``round(x 2^fixed_bits)`` as int32;
2. split into chunks of ``chunk`` values, one packet each; keep at most
   ``window`` chunks outstanding;
3. retransmit a chunk whose result has not come back after ``retransmit``
   seconds (the aggregator answers a complete chunk from its shadow copy and
   never counts a worker twice); every packet of the call carries the call's
   random nonce, so the aggregator refuses a second call that reuses the chunk
   ids (:class:`AggregatorRefusedError`) instead of answering it with the first
   call's sums;
4. accept only results of this session (its token; in a keyed session, a valid
   tag — forgeries are counted in :attr:`InaStats.rejected` and dropped) and check
   every result's epoch against the first one: a restarted aggregator raises
   :class:`AggregatorRestartedError` instead of mixing partial sums;
5. decode the results — the same bytes on every worker, so the sum is bitwise
   identical everywhere.

No progress for ``timeout`` seconds raises :class:`~sparcml.errors.CommTimeoutError`
naming the workers the aggregator is still waiting for.

The session (:class:`~sparcml.ina.session.InaSession`, agreed by the workers
through their process group with :func:`~sparcml.ina.session.agree_session`)
is sparcml's addition: paper 004's and SwitchML's workers trust the network.
"""

from __future__ import annotations

import json
import os
import socket
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..compress.base import make_header
from ..compress.natural import NaturalCompression
from ..errors import CommError, CommTimeoutError
from ..finite import all_finite
from .packet import (
    DATA,
    FLAG_MAC,
    HEADER,
    REFUSED,
    RESULT,
    STATS,
    STATS_REPLY,
    TAG_BYTES,
    WINDOW,
    Packet,
    PacketError,
    build,
    parse,
    verify,
)
from .session import InaSession, mode_code

__all__ = [
    "AggregatorRefusedError",
    "AggregatorRestartedError",
    "InaSession",
    "InaStats",
    "encode_natural",
    "ina_allreduce",
    "worker_seed",
]


class AggregatorRestartedError(CommError):
    """The aggregator's epoch changed during a job: its state was lost."""


class AggregatorRefusedError(CommError):
    """The aggregator refused this call: its call number was used already in the
    session (a replay; its results would be an earlier call's sums) or the
    session is past it. Open a new session (:func:`~sparcml.ina.agree_session`)."""


@dataclass
class InaStats:
    packets_sent: int = 0
    bytes_sent: int = 0
    retransmissions: int = 0
    clipped: int = 0
    rejected: int = 0  # received datagrams dropped: malformed, foreign, forged
    epoch: int | None = None
    extra: dict[str, int] = field(default_factory=dict)


def ina_allreduce(
    tensor: torch.Tensor,
    server: tuple[str, int],
    session: InaSession,
    rank: int,
    world: int,
    mode: str = "natural",
    *,
    job: int = 0,
    e_min: int = -50,
    fixed_bits: int = 16,
    chunk: int = 256,
    window: int = WINDOW,
    retransmit: float = 0.02,
    timeout: float = 10.0,
    seed: int = 0,
    call: int = 0,
    stats: InaStats | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` over the ``world`` workers of ``session`` through the aggregator.

    Args:
        tensor: this worker's values (any shape; summed as float32).
        server: the aggregator's (host, port) (or a relay's).
        session: the session the workers agreed on (the same on every worker; one per
            mode and membership: :func:`~sparcml.ina.session.agree_session`).
        rank / world: this worker, and the number of workers (the session's members).
        mode: ``"natural"`` (8 bits per value) or ``"fixed"`` (int32 fixed point).
        e_min: smallest exponent of the natural code (values below round to 0 or 2^e_min).
        fixed_bits: fractional bits of the fixed-point mode.
        chunk / window: values per packet, packets in flight.
        retransmit / timeout: the least seconds before resending a chunk (the timer
            follows three smoothed round trips, backing off per chunk) / before giving up.
        job: a label mixed into the seed of the stochastic rounding (the aggregator
            tells jobs apart by session, not by this number).
        seed: seed of this worker's stochastic rounding (mixed with rank, job and call).
        call: this call's number within the job, the same on every worker (0, 1, ...):
            chunk ids are ``call * 2^32 + i``, so a call never meets an earlier
            call's results (the aggregator keeps shadow copies of those). The calls
            of a session go forward and one at a time on each worker: once call
            ``c + 1`` reaches the aggregator, call ``c - 1`` is history to it.
        stats: an :class:`InaStats` to fill in (packets, bytes, retransmissions, clipping).

    Returns:
        The sum (``NATURAL``: the aggregator's re-compressed sum), shaped like
        ``tensor``, the same bits on every worker.

    Raises:
        CommTimeoutError: no progress for ``timeout`` s (names the missing workers).
        AggregatorRestartedError: the aggregator restarted during the call.
        AggregatorRefusedError: ``call`` was used already in this session (or the
            session is past it): no earlier call's sum is ever returned.
        ValueError: bad arguments.
    """
    code = mode_code(mode)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if not 0 <= call < 2**31:
        raise ValueError(f"call must be in [0, 2^31), got {call}")
    if not 1 <= chunk <= 1024 or window < 1:
        raise ValueError(f"chunk must be in [1, 1024] and window >= 1, got {chunk}, {window}")
    if not (retransmit > 0 and timeout > 0):  # (0 would make the socket non-blocking)
        raise ValueError(f"retransmit and timeout must be positive, got {retransmit}, {timeout}")
    st = stats if stats is not None else InaStats()
    flat = tensor.detach().reshape(-1).to("cpu", torch.float32)  # the transport boundary
    n = flat.numel()
    if n == 0:  # nothing to aggregate: no packet is sent
        return tensor.detach().clone()
    # Step 1: encode.
    if mode == "natural":
        values, clipped = encode_natural(flat, e_min, world, worker_seed(seed, job, rank, call))
        st.clipped += clipped
    else:
        if not all_finite(flat):  # (NaN passes the range check and casts to 0)
            raise ValueError(f"fixed point: a non-finite value among the {n} values")
        scaled = torch.round(flat.double() * 2.0**fixed_bits)
        if n and float(scaled.abs().max()) > 2**31 - 1:
            raise ValueError(f"fixed point: values reach {float(flat.abs().max()):g}, beyond "
                             f"int32 with {fixed_bits} fractional bits")  # fmt: skip
        values = scaled.to(torch.int64).numpy().astype(">i4")
    # Step 2: one packet per chunk, all carrying this call's nonce (in the epoch field)
    nchunks = (n + chunk - 1) // chunk
    base = call << 32
    token, key = session.token, session.key
    nonce = int.from_bytes(os.urandom(4), "little") or 1
    packets = [
        build(
            Packet(
                DATA,
                token,
                nonce,
                rank,
                world,
                base + c,
                code,
                min(chunk, n - c * chunk),
                values[c * chunk : (c + 1) * chunk].tobytes(),
            ),
            key,
        )
        for c in range(nchunks)
    ]
    results: dict[int, bytes] = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    try:
        outstanding: dict[int, float] = {}
        attempts: dict[int, int] = {}
        first_sent: dict[int, float] = {}
        srtt: float | None = None  # smoothed round trip, as TCP estimates it (RFC 6298)
        nxt = 0
        last_progress = time.monotonic()
        while len(results) < nchunks:
            now = time.monotonic()
            # SwitchML's pool: chunk j only once j < oldest outstanding + window, so at
            # most window - 1 chunks complete after any this worker still waits for, and
            # an aggregator keeping ``slots >= window`` results still holds its result
            # when it asks again (a window of outstanding chunks let a worker missing
            # one result run ahead until that result was dropped for room)
            oldest = next(iter(outstanding), nxt)  # (sent in order: the first key)
            while nxt < nchunks and nxt < oldest + window:
                sock.sendto(packets[nxt], server)
                st.packets_sent += 1
                st.bytes_sent += len(packets[nxt])
                outstanding[nxt] = now
                first_sent[nxt] = now
                nxt += 1
            sock.settimeout(retransmit / 2)
            try:
                buf = sock.recv(65535)
            except TimeoutError:
                buf = b""
            if buf:
                p = _result(buf, session, world, code)
                if p is None:
                    st.rejected += 1
                elif p.kind == REFUSED:
                    if p.worker == rank and st.epoch is not None and p.epoch != st.epoch:
                        # (an aggregator restarted since this call's first result
                        # refuses its chunks as stale: say what happened)
                        raise AggregatorRestartedError(
                            f"worker {rank}: the aggregator restarted during {session} "
                            f"(epoch {st.epoch} -> {p.epoch}); its partial sums are lost"
                        )
                    if p.worker == rank and p.chunk - base in outstanding:
                        reason = p.payload.decode("utf-8", "replace")
                        raise AggregatorRefusedError(
                            f"worker {rank}: the aggregator refused call {call} of {session}: "
                            f"{reason}"
                        )
                    st.rejected += 1  # a refusal of an earlier call's late retransmission
                else:
                    # Step 4: the aggregator's incarnation must not change.
                    if st.epoch is None:
                        st.epoch = p.epoch
                    elif p.epoch != st.epoch:
                        raise AggregatorRestartedError(
                            f"worker {rank}: the aggregator restarted during {session} (epoch "
                            f"{st.epoch} -> {p.epoch}); its partial sums are lost"
                        )
                    c = p.chunk - base
                    if c in outstanding and p.count == min(chunk, n - c * chunk):
                        results[c] = p.payload
                        del outstanding[c]
                        last_progress = time.monotonic()
                        if c not in attempts:  # Karn: only unambiguous samples
                            sample = last_progress - first_sent[c]
                            srtt = sample if srtt is None else 0.875 * srtt + 0.125 * sample
            # Step 3: retransmit what is overdue.
            now = time.monotonic()
            # before the first sample, wait 0.2 s: a window sent at once queues at the
            # aggregator, and resending it all would only lengthen the queue
            rto = max(retransmit, 3 * srtt if srtt is not None else 0.2)
            for c, sent in list(outstanding.items())[:window]:
                # back off per chunk: a slow aggregator must not be flooded
                if now - sent > rto * 2 ** min(attempts.get(c, 0), 6):
                    attempts[c] = attempts.get(c, 0) + 1
                    sock.sendto(packets[c], server)
                    st.packets_sent += 1
                    st.bytes_sent += len(packets[c])
                    st.retransmissions += 1
                    outstanding[c] = now
            if now - last_progress > timeout:
                raise CommTimeoutError(
                    _missing(sock, server, session, rank, world, timeout), peer=None
                )
    finally:
        sock.close()
    # Step 5: decode.
    if mode == "natural":
        codes = torch.frombuffer(bytearray(b"".join(results[i] for i in range(nchunks))),
                                 dtype=torch.uint8)  # fmt: skip
        # the aggregator's codes are appendix A's 8-bit format: decode them as such
        payload = torch.cat([make_header(3, n), codes])
        out = NaturalCompression(format=8, e_min=e_min).dequantize(
            payload, torch.float32, torch.device("cpu")
        )
    else:
        sums = np.frombuffer(b"".join(results[i] for i in range(nchunks)), dtype=">i8")
        out = torch.from_numpy(sums.astype(np.float64)).div_(2.0**fixed_bits).float()
    return out.reshape(tensor.shape).to(device=tensor.device, dtype=tensor.dtype)


def worker_seed(seed: int, job: int, rank: int, call: int = 0) -> int:
    """The seed of a worker's stochastic rounding: distinct per worker, job and call."""
    return zlib.crc32(f"{seed}/{job}/{rank}/{call}".encode())


def encode_natural(flat: torch.Tensor, e_min: int, world: int, seed: int) -> tuple[np.ndarray, int]:
    """Step 1: 8-bit codes of ``flat`` (offsets clipped for ``world`` workers), clip count."""
    q = NaturalCompression(format=8, e_min=e_min, seed=seed)
    body = q.quantize(flat).numpy()[16:].astype(np.int64)
    bound = 62 - max(0, (world - 1).bit_length())
    offset = body & 63
    # (a value beyond the format's top has offset 63 > bound: counted here once)
    clipped = int((offset > bound).sum())
    return ((body & 0xC0) | np.minimum(offset, bound)).astype(np.uint8), clipped


def _result(buf: bytes, session: InaSession, world: int, code: int) -> Packet | None:
    """The result (or refusal) ``buf`` holds if it is one of this session's (authentic),
    else None."""
    try:
        p = parse(buf)
    except PacketError:
        return None
    if p.kind not in (RESULT, REFUSED) or p.session != session.token:
        return None
    if p.mode != code or p.workers != world:
        return None
    if session.key is not None and not (p.flags & FLAG_MAC and verify(buf, session.key)):
        return None
    if session.key is None and p.flags & FLAG_MAC:
        return None
    return p


#: what the aggregator's rejection reasons that concern the secret say of a session
SECRET_MISMATCH = {
    "bad_mac": "tags that do not verify: the ranks' secret is not the aggregator's --secret-file",
    "mac_required": "untagged packets: the aggregator has a secret, the ranks none",
    "no_key": "tagged packets: the ranks have a secret, the aggregator none",
}

STATS_REQUEST_BYTES = 1200  # the padded size of a STATS request: the reply fits in it


def _missing(
    sock: socket.socket,
    server: tuple[str, int],
    session: InaSession,
    rank: int,
    world: int,
    timeout: float,
) -> str:
    """Ask the aggregator which workers it still waits for (best effort)."""
    text = f"worker {rank}: no progress for {timeout:g}s in {session}"
    # the reply is never longer than the request: pad it (STATS_REQUEST_BYTES in all)
    pad = bytes(STATS_REQUEST_BYTES - HEADER.size - (TAG_BYTES if session.key is not None else 0))
    try:
        sock.sendto(
            build(Packet(STATS, session.token, 0, rank, world, 0, 0, 0, pad), session.key), server
        )
        sock.settimeout(1.0)
        deadline = time.monotonic() + 1.0
        while True:
            buf = sock.recv(65535)
            try:
                p = parse(buf)
            except PacketError:  # a stray or late datagram: not the answer
                p = None
            if p is not None and p.kind == STATS_REPLY:
                break
            if time.monotonic() > deadline:
                raise TimeoutError
        try:
            reply = json.loads(p.payload)
        except ValueError:  # (empty, or cut to the request's length)
            return f"{text}: the aggregator runs but sent no detail of its state"
        rejects = {
            k[9:]: v for k, v in reply.get("counters", {}).items() if k.startswith("rejected_")
        }
        why = f"; it rejected packets: {rejects}" if rejects else ""
        mine = reply.get("session") if p.session == session.token else None
        if session.key is not None and mine is not None and not verify(buf, session.key):
            mine = None
        if mine is None:
            # (its counters are the aggregator's, over every session and its whole
            # life: a likely cause, next to expiry, not a verdict)
            keyed = [SECRET_MISMATCH[r] for r in rejects if r in SECRET_MISMATCH]
            cause = f"expired, or a secret mismatch? {'; '.join(keyed)}" if keyed else "expired?"
            return f"{text}: the aggregator holds no state of this session ({cause}){why}"
        if mine.get("missing"):
            return (
                f"{text}: the aggregator is waiting for worker(s) [{mine['missing']}] (dead?){why}"
            )
        return f"{text}: the aggregator holds no incomplete chunk of this session{why}"
    except (OSError, PacketError, ValueError, KeyError, AttributeError):
        return f"{text}: the aggregator did not answer (is it running?)"
