"""The consistency headers every ``sparse_allreduce`` call checks (one owner).

Every call first gathers a few integers per rank (size, dtype, nnz, the call
number, the caller's ``call_id``, a NaN/Inf flag when quantizing, and the call's
settings: algorithm, quantizer and its parameters, quantize mode, index coding,
``k``, whether this rank refused them, owner) on every rank: a recursive-doubling
exchange of 48-byte headers, ``log2 P`` messages per rank (``P-1`` direct messages
on a backend without failure agreement, MPI), or the same headers carried inside an algorithm's own
first round or rounds (:class:`~sparcml.collectives.codec.FirstRound`,
:class:`~sparcml.collectives.codec.CarriedHeaders`). Mismatched calls then fail
with the same clear error on every rank instead of hanging or corrupting data,
and ``auto`` gets every rank's nnz for its plan (:mod:`.autotune`). Beyond the
papers, which assume matching calls.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import torch

from ..comm import Communicator
from ..comm.abort import mark_uniform
from ..compress.base import Quantizer
from ..errors import NonFiniteError, RankMismatchError
from ..finite import all_finite
from ..reinterpret import as_bytes, bytes_as
from ..stream import SparseStream
from ..wire import code_dtype, dtype_code
from ._common import held_ranks, largest_power_of_two
from .codec import HEADER_BYTES, INDEX_CODINGS, QUANTIZE_MODES
from .registry import algorithms

__all__ = [
    "HEADER_MAGIC",
    "CallSettings",
    "check_consistent",
    "check_headers",
    "consistency_header",
    "gather_headers",
    "state_variant",
]

_MASK32 = (1 << 32) - 1


def gather_headers(header: torch.Tensor, comm: Communicator) -> list[torch.Tensor]:
    """Every rank's ``header`` (equal sizes), by recursive doubling: ``log2 P'`` rounds.

    Rank ``r >= P'`` (``P'`` the largest power of two ``<= P``) first sends its header
    to ``r - P'`` and gets all of them back at the end (Appendix A's fold); in round
    ``t`` rank ``r < P'`` sends the headers it holds (its group of ``2^(t-1)`` ranks,
    folded ones included) to ``r XOR 2^(t-1)`` and receives that group's. So
    ``log2 P'`` messages per rank (two more for the fold), ``(P-1)`` headers
    received, where a direct exchange takes ``P-1`` messages. A rank that is dead or
    absent stalls its partners first; the others name it all the same through the
    communicator's agreement on the failed rank
    (:attr:`~sparcml.comm.Communicator.agrees_on_failures`).

    Raises:
        RankMismatchError: a partner sent a message of the wrong size.
    """
    p, me = comm.world_size, comm.rank
    width = header.numel()
    out: list[torch.Tensor | None] = [None] * p
    out[me] = header
    p2 = largest_power_of_two(p)

    def take(buf: torch.Tensor, src: int, ranks: list[int]) -> None:
        # (bytes beyond the headers: a partner that carries them in recursive
        # doubling's data messages, ``header_in_rounds``; its header says so and
        # check_headers refuses the mix on every rank)
        if buf.numel() < width * len(ranks):
            # some ranks may never get this far: tell them (sparcml.comm.abort)
            raise mark_uniform(RankMismatchError(
                f"rank {src} sent {buf.numel()} bytes where {len(ranks)} consistency "
                f"headers ({width * len(ranks)} bytes) were due: it is not in the same "
                "collective call (another algorithm or collective, or another sparcml "
                "version)"), False)  # fmt: skip
        for i, r in enumerate(ranks):
            out[r] = buf[i * width : (i + 1) * width]

    if me >= p2:  # fold: hand the header to rank me - P', get every header back
        # (the receive posted before the send is waited for: on gloo a send completes
        # only once the peer receives, and a peer that failed sends its note instead)
        take(
            comm.sendrecv(header, me - p2, exchange=False),  # (answered in the unfold)
            me - p2,
            [r for r in range(p) if r != me],
        )
        return [h for h in out if h is not None]
    if me < p - p2:
        take(comm.recv(me + p2), me + p2, [me + p2])
    mask = 1
    while mask < p2:
        partner = me ^ mask
        mine = held_ranks(me, mask, p, p2)
        sent = torch.cat([out[r].to(header.device) for r in mine])  # type: ignore[union-attr]
        take(comm.sendrecv(sent, partner), partner, held_ranks(partner, mask, p, p2))
        mask <<= 1
    if me < p - p2:  # unfold
        unfold = [out[r].to(header.device) for r in range(p) if r != me + p2]  # type: ignore[union-attr]
        comm.send(torch.cat(unfold), me + p2)
    return [h for h in out if h is not None]


HEADER_MAGIC = 0x5C4D
"""The top 16 bits of a header's settings word: a buffer without them is no header."""


def _name_id(name: str) -> int:
    """A 16-bit id of a name (never 0, which stands for "none")."""
    return (zlib.crc32(name.encode()) & 0xFFFF) or 1


@functools.lru_cache(maxsize=64)
def _named_quantizer(name: str) -> tuple[str, str]:
    """A quantizer name's (name, parameters but the seed) with its defaults."""
    from ..compress import get

    try:
        q = get(name)
    except (ValueError, TypeError, KeyError):
        return name, ""
    return getattr(q, "name", name), repr({k: v for k, v in q.params().items() if k != "seed"})


def state_variant(state: Any) -> str:
    """An Ok-Topk state's settings and call count, which decide its messages (tau:
    boundary refreshes, tau_prime: threshold refreshes, quantiles: the boundary
    samples, two_level), as compared across ranks; "" for no state."""
    if state is None or not hasattr(state, "tau_prime"):
        return ""
    return (f"tau={state.tau},tau'={state.tau_prime},q={state.quantiles},"
            f"2l={int(bool(state.two_level))},call={state.calls}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """What the ranks of one call must pass alike beyond size and dtype: the
    algorithm asked for (``"auto"`` or a name), the quantizer (its name, and its
    parameters but the seed, which may differ per rank), the quantize mode and
    index coding (only with a quantizer: without one they change nothing), and
    ``k`` (``oktopk``, ``gaussiank``). Carried in the consistency header, so a
    difference is refused with :class:`~sparcml.errors.RankMismatchError` naming
    the setting, before any data is used (beyond the papers, like the whole check).

    ``refused``: this rank found its settings invalid (an unknown value or option,
    whatever the header can spell). A rank that refuses sends its header with this
    set, so ranks that accepted theirs fail on the difference at once instead of
    waiting for it in the algorithm; ranks that all refuse alike each raise their
    own error.
    """

    algorithm: str = "auto"
    quantizer: str | None = None
    quantizer_params: str = ""
    quantize: str = "dense"
    index_coding: str = "auto"
    k: int | None = None
    inner: str | None = None  # the two-level algorithms' algorithm between nodes
    refused: bool = False
    #: a 7-bit fingerprint of the node topology the call would use (0: none, the
    #: algorithm ignores nodes): ranks that disagree on their nodes would pair the
    #: wrong ranks and sum the wrong pieces, silently (:func:`topology_fingerprint`)
    topology: int = 0
    #: what else decides the call's messages, compared as part of the algorithm:
    #: with ``"auto"`` its cost model (:func:`~sparcml.collectives.autotune.auto_policy`,
    #: "" when it measures), with Ok-Topk its state's settings and call count (ranks
    #: whose models or states differ would run different messages)
    variant: str = ""

    @classmethod
    def of(
        cls,
        algorithm: str,
        quantizer: Quantizer | str | None,
        quantize: str,
        index_coding: str,
        options: dict[str, Any],
    ) -> CallSettings:
        """The settings of a ``sparse_allreduce`` call as given (invalid values too:
        they are compared first, checked after)."""
        k = options.get("k")
        k = int(k) if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else None
        inner = str(options["inner"]) if "inner" in options else None
        # (an Ok-Topk state's variant is read when the call runs: state_variant)
        variant = ""
        if quantizer is None:
            return cls(str(algorithm), k=k, inner=inner, variant=variant)
        if isinstance(quantizer, str):
            # a name stands for the quantizer with its defaults, which a rank may pass
            # as an object instead (an unknown name is refused after the comparison)
            name, params = _named_quantizer(quantizer)
        else:
            name = getattr(quantizer, "name", type(quantizer).__name__)
            params = repr({k: v for k, v in quantizer.params().items() if k != "seed"})
        return cls(str(algorithm), name, params, str(quantize), str(index_coding), k, inner,
                   variant=variant)  # fmt: skip

    def words(self) -> tuple[int, int]:
        """The header's settings words: (magic, algorithm, quantizer, topology, refused,
        mode, coding) and (quantizer parameters, k + 1), as signed int64."""
        q = _name_id(self.quantizer) if self.quantizer is not None else 0
        mode = QUANTIZE_MODES.index(self.quantize) + 1 if self.quantize in QUANTIZE_MODES else 15
        known = self.index_coding in INDEX_CODINGS
        coding = INDEX_CODINGS.index(self.index_coding) + 1 if known else 15
        if self.quantizer is None:
            mode = coding = 0
        algorithm = self.algorithm if self.inner is None else f"{self.algorithm}:{self.inner}"
        w3 = (HEADER_MAGIC << 48) | (_name_id(algorithm) << 32) | (q << 16)
        w3 |= ((self.topology & 0x7F) << 9) | (int(self.refused) << 8) | (mode << 4) | coding
        qp = zlib.crc32(self.quantizer_params.encode()) & 0xFFFF if self.quantizer else 0
        # k + 1 in 40 bits (from 2^40 - 2 on, one value: k that large never differ in
        # practice), the variant's 8-bit fingerprint above it (0: none)
        kk = 0 if self.k is None else min(self.k + 1, _K_TOP)
        var = zlib.crc32(self.variant.encode()) % 255 + 1 if self.variant else 0
        w4 = (qp << 48) | (var << 40) | kk
        return _signed(w3), _signed(w4)


#: the fingerprint of a layout the ranks will find by gathering their node keys
#: (the same on every rank by construction): not known before the call's header
TOPOLOGY_GATHERED = 0x7F


@functools.lru_cache(maxsize=64)
def topology_fingerprint(topology: Any | None) -> int:
    """A 7-bit fingerprint (1-126) of a :class:`~sparcml.comm.topology.Topology`'s nodes,
    or :data:`TOPOLOGY_GATHERED` for None (a layout to be gathered). Two different
    layouts share one with a chance of 1 in 126 (the header has 7 bits to spare)."""
    if topology is None:
        return TOPOLOGY_GATHERED
    return zlib.crc32(repr(topology.nodes).encode()) % 126 + 1


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def _names(ids: list[int], known: list[str]) -> list[str]:
    """Readable names of 16-bit ids, looked up among ``known``."""
    table = {_name_id(n): n for n in known}
    return [("none" if i == 0 else repr(table[i]) if i in table else f"unknown (id {i:#06x})")
            for i in ids]  # fmt: skip


def consistency_header(
    stream: SparseStream,
    sequence: int,
    call_id: int | None = None,
    lossy: bool = False,
    nonfinite: bool = False,
    carried: bool | str = False,
    settings: CallSettings | None = None,
    rank: int = 0,
) -> tuple[torch.Tensor, bool]:
    """Rank ``rank``'s 48-byte header for :func:`check_consistent` and whether the call must
    be refused for NaN/Inf: values a quantizer cannot encode (``lossy``), or the
    caller's own verdict on the data behind the stream (``nonfinite``). ``carried``:
    the header travels in the algorithm's own messages (:class:`FirstRound`), not
    in the separate exchange (``"first_round"``: in the split phase's messages, a
    message pattern of its own); ranks that differ in this are refused alike.
    ``settings``: the call's :class:`CallSettings` (default: ``auto``, no quantizer)."""
    bad = nonfinite or (lossy and not all_finite(stream.values))
    # six words: size, (flags << 56 | dtype << 48 | nnz), (call_id << 32 | call
    # number), the last two modulo 2^32 (no call_id: all ones), the settings' two
    # (CallSettings.words) and the rank whose header it is; flags: 1 = NaN/Inf,
    # 2 = carried, 4 = in the first round
    how = 6 if carried == "first_round" else 2 if carried else 0
    packed = ((int(bad) | how) << 56) | (dtype_code(stream.dtype) << 48) | stream.nnz
    cid = _MASK32 if call_id is None else call_id & _MASK32
    calls = (cid << 32) | (sequence & _MASK32)
    w3, w4 = (settings or CallSettings()).words()
    meta = torch.tensor([stream.size, packed, _signed(calls), w3, w4, rank], dtype=torch.int64)
    return as_bytes(meta), bad


def _differ(rows: list[list[int]], col: int) -> bool:
    return len({r[col] for r in rows}) > 1


def _setting_names(what: str, ids: list[int]) -> list[str]:
    """Readable values of one header setting column (only when a setting differs:
    the tables are built then, not on every call)."""
    if what == "algorithm":
        names = algorithms()
        return _names(ids, ["auto", *names, *(f"{a}:{b}" for a in names for b in names)])
    if what == "cost model or Ok-Topk state":
        return ["none (auto measuring)" if i == 0 else f"fingerprint {i:#04x}" for i in ids]
    if what == "quantizer":
        from ..compress import available

        return _names(ids, [n for n, kind in available().items() if kind == "quantizer"])
    if what in ("quantize mode", "index coding"):
        valid = QUANTIZE_MODES if what == "quantize mode" else INDEX_CODINGS
        return [("unused (no quantizer)" if i == 0 else
                 repr(valid[i - 1]) if i <= len(valid) else "invalid") for i in ids]  # fmt: skip
    if what == "k":
        return ["none" if i == 0 else str(i - 1) for i in ids]
    return [f"{i:#06x}" for i in ids]  # quantizer parameters: a fingerprint


#: (row column, setting) of the header's settings, in the order they are reported
_SETTING_COLUMNS = [(6, "algorithm"), (7, "quantizer"), (8, "quantizer parameters"),
                    (9, "quantize mode"), (10, "index coding"), (11, "k")]  # fmt: skip
#: compared after the refusals: a rank that refused its settings may not have
#: found its model or read its state
_VARIANT_COLUMN = (14, "cost model or Ok-Topk state")

#: the largest k + 1 the header holds
_K_TOP = (1 << 40) - 1


def check_headers(got: list[torch.Tensor]) -> list[int]:
    """Every rank's nnz from every rank's header (rank order), or the error every rank
    raises alike (they all hold the same headers); see :func:`check_consistent`.

    A difference in the algorithm or in how the header travels means the ranks ran
    different message patterns, so some may never see these headers: such an error
    is marked non-uniform, and the ranks that raise it tell the others
    (:mod:`sparcml.comm.abort`)."""
    rows = []
    for r, buf in enumerate(got):
        if buf.numel() < HEADER_BYTES:
            raise mark_uniform(RankMismatchError(
                f"rank {r} sent {buf.numel()} bytes where its consistency header was due: it "
                "is not in the same collective call (another algorithm or collective, or "
                "another sparcml version)"), False)  # fmt: skip
        size, packed, calls, w3, w4, owner = bytes_as(
            buf[:HEADER_BYTES].cpu(), torch.int64
        ).tolist()
        if (w3 >> 48) & 0xFFFF != HEADER_MAGIC or owner != r:
            raise mark_uniform(RankMismatchError(
                f"rank {r} sent something other than its consistency header where that "
                "was due: it is not in the same collective call (another algorithm or "
                "collective, or another sparcml version)"), False)  # fmt: skip
        nnz, code, flag = packed & ((1 << 48) - 1), (packed >> 48) & 0xFF, packed >> 56
        cid = (calls >> 32) & _MASK32
        rows.append([size, code, nnz, calls & _MASK32, -1 if cid == _MASK32 else cid, flag,
                     (w3 >> 32) & 0xFFFF, (w3 >> 16) & 0xFFFF, (w4 >> 48) & 0xFFFF,
                     (w3 >> 4) & 0xF, w3 & 0xF, w4 & _K_TOP,
                     (w3 >> 8) & 1, (w3 >> 9) & 0x7F, (w4 >> 40) & 0xFF])  # fmt: skip
    # headers in the split phase on some ranks only: different message patterns, and
    # some ranks may never hold these headers (the separate exchange and recursive
    # doubling's rounds send the same messages)
    uniform = len({r[5] >> 2 for r in rows}) == 1

    def refuse(text: str) -> None:
        raise mark_uniform(RankMismatchError(text), uniform)

    def each(values: list[Any]) -> str:
        return ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))

    if _differ(rows, 0):
        refuse(f"sparse_allreduce called with different sizes across ranks "
               f"({each(['N=' + str(r[0]) for r in rows])})")  # fmt: skip
    if _differ(rows, 1):
        refuse(f"sparse_allreduce called with different dtypes across ranks "
               f"({each([code_dtype(r[1]) for r in rows])})")  # fmt: skip
    for col, what in ((3, "call number"), (4, "call_id")):
        if _differ(rows, col):
            numbers = each([f"{what} {r[col]}" for r in rows])
            refuse(
                f"ranks are in different collective calls ({numbers}): a rank skipped a call "
                "or made an extra one; every rank must make the same calls in the same order"
            )
    for col, what in _SETTING_COLUMNS:
        if _differ(rows, col):
            values = _setting_names(what, [r[col] for r in rows])
            refuse(f"ranks passed different {what} settings to the same call "
                   f"({each(values)})")  # fmt: skip
    if len({r[13] for r in rows if r[13]}) > 1:  # (0: the algorithm ignores nodes)
        prints = each([f"{r[13]:#04x}" if r[13] else "none" for r in rows])
        refuse(
            f"ranks see different node topologies ({prints}, fingerprints of their "
            "layouts): a two-level or node-aware algorithm would pair the wrong ranks; "
            "set SPARCML_RANKS_PER_NODE (or call set_topology) alike on every rank"
        )
    if _differ(rows, 12):
        refused = [r for r, row in enumerate(rows) if row[12]]
        err = RankMismatchError(
            f"rank(s) {refused} refused this call's settings (an invalid value or option, "
            "which their own error names) where the other ranks accepted theirs: every "
            "rank must pass the same settings"
        )
        err.refused = refused  # type: ignore[attr-defined]  # (the refusing ranks raise their own)
        raise mark_uniform(err, uniform)
    col, what = _VARIANT_COLUMN
    if _differ(rows, col):
        values = _setting_names(what, [r[col] for r in rows])
        refuse(
            f"ranks passed different {what} settings to the same call ({each(values)}): "
            "with algorithm='auto' on every rank their cost models differ (a calibration "
            "file, $SPARCML_CALIBRATION or ~/.config/sparcml/calibration.json, on some "
            "hosts only; SPARCML_AUTO; cost_model=), and they would choose different "
            "algorithms: give every rank the same; with Ok-Topk, their states differ (tau, "
            "tau_prime, quantiles, two_level or the call count: a state resumed or made "
            "on some ranks only)"
        )
    carried = [r[5] >> 1 for r in rows]
    if len(set(carried)) > 1:
        how = {0: "exchanged first", 1: "in recursive doubling's rounds", 3: "in the split phase"}
        detail = ", ".join(f"rank {i}: {how.get(c, '?')}" for i, c in enumerate(carried))
        refuse(
            f"ranks sent their consistency headers differently ({detail}): they are not "
            "running the same algorithm (an explicit algorithm= on some ranks only, or "
            "auto's choices differ)"
        )
    flagged = [i for i, r in enumerate(rows) if r[5] & 1]
    if flagged:
        raise NonFiniteError(
            f"NaN/Inf values on rank(s) {flagged}: refused on every rank (a quantizer cannot "
            "encode them, a selection would hide them; sparcml.torch's nan_policy handles "
            "them for gradients)"
        )
    return [r[2] for r in rows]


def check_consistent(
    stream: SparseStream,
    comm: Communicator,
    *,
    sequence: int | None = None,
    call_id: int | None = None,
    lossy: bool = False,
    nonfinite: bool = False,
    settings: CallSettings | None = None,
) -> list[int]:
    """Check that every rank passes the same size and dtype; return every rank's nnz.

    The ranks gather every rank's (size, dtype, nnz, call number, ``call_id``, NaN
    flag), 24 bytes, by recursive doubling (:func:`gather_headers`, ``log2 P``
    messages per rank) on communicators that agree on the failed rank, else
    straight from every peer (``P-1`` messages); either way a rank that is dead or
    not calling the collective is named by every peer's error, not just by a
    neighbour's. (Algorithms whose first round is a message to every peer carry
    the header in it instead: :class:`~sparcml.collectives.codec.FirstRound`.)

    Args:
        sequence: this call's number on the communicator (default: the next one,
            :meth:`~sparcml.comm.Communicator.next_sequence`). Ranks whose counts
            differ have made a different number of calls.
        call_id: the caller's own number for the call (e.g. the training step): a
            rank that skipped one call and made an extra one later keeps the same
            count, but not the same ``call_id``.
        lossy: values will be quantized: NaN/Inf on any rank is refused on every rank.
        nonfinite: this rank's data holds NaN/Inf (the caller's verdict, see
            :func:`sparse_allreduce`): refused on every rank.
        settings: the call's :class:`CallSettings` (algorithm, quantizer, ``k``, ...),
            compared too.

    Raises:
        RankMismatchError: on every rank, naming the ranks that differ.
        NonFiniteError: a rank flagged NaN/Inf (``lossy`` values or ``nonfinite``), on
            every rank.
        CommTimeoutError / PeerFailedError: naming a rank that did not answer.
    """
    seq = comm.next_sequence() if sequence is None else sequence
    payload, _ = consistency_header(
        stream, seq, call_id, lossy, nonfinite, settings=settings, rank=comm.rank
    )
    with comm.control():
        if comm.agrees_on_failures:
            got = gather_headers(payload, comm)
        else:
            got = comm.alltoallv([payload] * comm.world_size)
    return check_headers(got)
