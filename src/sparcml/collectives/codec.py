"""How the collectives put sparse streams on the wire, with or without value quantization.

SparCML quantizes "the dense stream" of the reduction (paper 000, sec. 6): the
second phase of ``dsar_split_allgather``, where the reduced ranges are dense,
with QSGD. A :class:`StreamCodec` holds that choice for one collective call:

* no quantizer: every message is the exact wire encoding (:mod:`sparcml.wire`);
* ``quantize="dense"`` (default with a quantizer): messages carrying a *dense*
  stream (DSAR's phase 2, any partial sum past ``delta``) have their values
  quantized; sparse messages stay exact;
* ``quantize="contributions"`` (SparCML's Alg. 1, ``g = sum_i Q(TopK(acc_i))``):
  every rank's own contribution is quantized exactly once, by that rank, and the
  partial sums travel exactly. The result's error is then the same whichever
  algorithm runs: ``P`` independent quantizations, nothing re-rounded. Messages
  that carry partial sums (the later stages of recursive doubling, the allgather
  phase of the split algorithms) are sent at full precision, so they cost more
  bytes than under ``"all"``;
* ``quantize="all"``: every message's values are quantized, partial sums
  included, at every stage: fewest bytes, but the error grows with the number
  of stages and depends on the algorithm (measured in docs/compression.md).

Randomness: a rank quantizing its own contribution (or a partial sum that only
it holds) draws from a generator seeded by ``(quantizer seed, rank, call
number)``: independent across ranks and calls, so rounding errors average out
instead of adding up. Only ranks that hold the same partial sum and must send
the same bytes (the partners of recursive doubling) share a seed
(:meth:`StreamCodec.shared_seed`).

Results stay bitwise identical on every rank: a quantized message is decoded
from its bytes by every rank that uses it, the sender included, and final
results are handed on exactly (:meth:`encode_exact`).

Index coding (``index_coding``, lossless whatever it is; :data:`INDEX_CODINGS`):

* ``"auto"`` (default): messages of CPU streams, exact and quantized, carry
  their indices Elias--Fano coded where that is smaller than the ``c``-byte fields
  (:mod:`sparcml.indexcode`, chosen per message); on other devices, whose fields
  would take a dozen kernel launches a message that fast device links rarely
  repay, the fixed fields (a GPU stream on a communicator that moves bytes through
  host memory, gloo's or MPI's, is a CPU stream in the call:
  :func:`~sparcml.collectives.allreduce.staged_on_host`); and the two-level
  algorithms' exact messages inside a node (no quantizer set) the fixed fields
  too, where bytes are cheap (:meth:`StreamCodec.inside_node`);
* ``"fixed"``: sec. 5.1's ``c``-byte fields in every message (the wire of
  version 2, no coding work);
* ``"elias-fano"``: as ``"auto"``, on every device;
* ``"delta"``: as ``"auto"``, and quantized messages on other devices carry
  varints of the gaps (:func:`sparcml.compress.packing.encode_index_deltas`).
  (Quantized CPU messages carried the varints until the Elias--Fano fields came
  to them too: smaller, about ``l + 2`` bits an index against a byte or two, and
  coded in one compiled pass instead of a dozen tensor operations: a message of
  5,000 indices of 2^20 with natural values encoded in 0.881 ms with varints,
  0.266 ms with the Elias--Fano field; ``benchmarks/quantized_index_coding.py``,
  docs/training.md.)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from ..comm.abort import mark_uniform
from ..compress.base import Quantizer, decode_quantized_stream, encode_quantized_stream
from ..errors import RankMismatchError, WireFormatError
from ..reinterpret import as_bytes, bytes_as
from ..stream import SparseStream
from ..wire import decode, decode_concat, encode, host_bytes

__all__ = [
    "EXACT",
    "HEADER_BYTES",
    "INDEX_CODINGS",
    "QUANTIZE_MODES",
    "CarriedHeaders",
    "FirstRound",
    "StreamCodec",
    "check_index_coding",
]

HEADER_BYTES = 48
"""Size of a rank's consistency header (:func:`~sparcml.collectives.headers.check_consistent`)."""

QUANTIZE_MODES = ("dense", "contributions", "all")

#: the index codings (module doc); the first two keep their numbers in the
#: consistency header of earlier versions
INDEX_CODINGS = ("fixed", "delta", "auto", "elias-fano")


def check_index_coding(index_coding: object) -> None:
    """Raise ``ValueError`` naming the choices unless ``index_coding`` is one of them."""
    if index_coding not in INDEX_CODINGS:
        names = ", ".join(map(repr, INDEX_CODINGS))
        raise ValueError(f"index_coding must be one of {names}, got {index_coding!r}")


# The base of the own-generator seeds of quantizers built with seed=None: random
# per process, so such runs are not reproducible but still independent across ranks.
_PROCESS_SEED = int.from_bytes(os.urandom(8), "little") >> 1


@dataclasses.dataclass
class FirstRound:
    """The consistency header carried by an algorithm's own messages.

    ``sparse_allreduce`` hands this to algorithms registered with
    ``header_in_first_round`` (their first round is a message to every peer: the
    split phase) or ``header_in_rounds`` (recursive doubling, whose rounds are the
    header exchange's own: :class:`CarriedHeaders`).
    :func:`~sparcml.collectives._common.split_and_reduce` puts ``header`` in front
    of each message, and ``check`` runs on every rank's header before anything
    received is used, so every rank raises the same error for mismatched calls,
    as the separate exchange would, without its ``log2 P`` rounds. With
    ``refuse`` (this rank holds NaN/Inf and a quantizer is set) the messages carry
    the header alone, and ``check`` raises :class:`~sparcml.errors.NonFiniteError`
    on every rank. ``ks``: every rank's nnz, once checked.
    """

    header: torch.Tensor
    refuse: bool
    check: Callable[[list[torch.Tensor]], list[int]]
    ks: list[int] | None = None


def _header_key(header: torch.Tensor) -> tuple[int, ...]:
    """What two ranks' headers must share: all but the nnz and the NaN flag's
    neighbours (size, flags and dtype, call numbers, settings)."""
    size, packed, calls, w3, w4, _ = bytes_as(header.cpu(), torch.int64).tolist()
    return size, packed >> 48, calls, w3, w4


class CarriedHeaders:
    """Consistency headers riding in recursive doubling's messages (``header_in_rounds``).

    Recursive doubling (with Appendix A's fold) sends exactly the messages of the
    header exchange (:func:`~sparcml.collectives.headers.gather_headers`): rank ``r``'s
    round-``t`` message goes to ``r XOR 2^(t-1)`` and can carry the headers of the
    ranks whose partial sum it holds. So every message starts with those headers
    (:meth:`wrap`), and after the last round (the unfold) every rank holds all
    ``P`` of them and checks them (:meth:`finish`): the errors of the separate
    exchange, in no rounds of its own.

    A header that differs from this rank's own in size, dtype, call number or
    ``call_id``, or that flags NaN/Inf, makes the rank *refuse*: from then on its
    messages carry the headers alone and it decodes nothing, but it still sends
    every message of the pattern, so its partners learn the headers too; the
    refusal spreads with the headers, and every rank raises the same error in
    :meth:`finish`. A rank that runs the separate exchange instead (``auto``
    before its choice is settled) sends the same messages without data: its
    header's "carried" bit differs, so this is refused alike instead of hanging.

    With ``first`` None (no header to carry) the messages are the payloads alone.
    """

    def __init__(self, first: FirstRound | None, me: int, device: torch.device) -> None:
        self.first = first
        self.device = device
        self.held: dict[int, torch.Tensor] = {}
        self.refuse = False
        if first is not None:
            self.held[me] = first.header
            self.refuse = first.refuse
            self._mine = _header_key(first.header)

    def wrap(self, ranks: Sequence[int], payload: torch.Tensor | None) -> torch.Tensor:
        """The message: the headers of ``ranks`` (held), then ``payload`` unless refusing."""
        if self.first is None:
            assert payload is not None
            return payload
        head = torch.cat([self.held[r].to(self.device) for r in ranks])
        if self.refuse or payload is None:
            return head
        return torch.cat([head, payload])

    def unwrap(self, buf: torch.Tensor, src: int, ranks: Sequence[int]) -> torch.Tensor | None:
        """Take the headers of ``ranks`` from ``src``'s message; its payload, or None
        when this rank refuses (now or before)."""
        if self.first is None:
            return buf
        n = HEADER_BYTES * len(ranks)
        if buf.numel() < n:
            raise mark_uniform(RankMismatchError(
                f"rank {src} sent {buf.numel()} bytes where {len(ranks)} consistency "
                "headers were due: it is not in the same collective call (another "
                "algorithm or collective, or another sparcml version)"), False)  # fmt: skip
        for i, r in enumerate(ranks):
            h = buf[i * HEADER_BYTES : (i + 1) * HEADER_BYTES].cpu()
            self.held[r] = h
            if not self.refuse:
                self.refuse = _header_key(h) != self._mine
        return None if self.refuse else buf[n:]

    def finish(self, p: int) -> None:
        """Check all ``P`` headers (the same error on every rank); sets ``first.ks``."""
        if self.first is None:
            return
        if len(self.held) != p:
            raise mark_uniform(RankMismatchError(
                f"consistency headers of ranks {sorted(self.held)} only, of {p}: the ranks "
                "ran different message patterns (different algorithms?)"), False)  # fmt: skip
        self.first.ks = self.first.check([self.held[r] for r in range(p)])
        if self.refuse:  # check() raises whenever a header differs: defensive
            raise WireFormatError("a rank refused the call but every header agrees")


class StreamCodec:
    """Encoder/decoder of the streams a collective sends (see the module docstring).

    Args:
        quantizer: a value quantizer (``sparcml.compress.get("qsgd", bits=4)``), or None.
        quantize: ``"dense"``, ``"contributions"`` or ``"all"`` (module docstring).
        index_coding: how indices travel (module doc): ``"auto"``, ``"fixed"``,
            ``"elias-fano"`` or ``"delta"``.
    """

    def __init__(
        self,
        quantizer: Quantizer | None = None,
        quantize: str = "dense",
        sequence: int = 0,
        index_coding: str = "auto",
        rank: int = 0,
    ) -> None:
        if quantizer is not None and not isinstance(quantizer, Quantizer):
            raise TypeError(
                f"quantizer must be a value quantizer such as sparcml.compress.get('qsgd'), "
                f"got {type(quantizer).__name__}"
            )
        if quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"quantize must be one of {', '.join(map(repr, QUANTIZE_MODES))}, got {quantize!r}"
            )
        check_index_coding(index_coding)
        self.quantizer = quantizer
        self.quantize = quantize
        self.index_coding = index_coding
        self.sequence = sequence  # the collective call's number, equal on every rank
        self.rank = rank
        self._own_gen: torch.Generator | None = None
        # this call's consistency header, when the first round carries it (taken by
        # split_and_reduce)
        self.first_round: FirstRound | None = None

    def with_call(self, sequence: int, rank: int) -> StreamCodec:
        """The same policy for one collective call: its number and this rank."""
        return StreamCodec(self.quantizer, self.quantize, sequence, self.index_coding, rank)

    def inside_node(self) -> StreamCodec:
        """The codec of the messages between ranks of one node (the two-level
        algorithms' steps inside the node). Under ``index_coding="auto"`` exact
        messages there carry the fixed index fields: bytes inside a node are cheap
        (NVLink, shared memory, loopback), while Elias--Fano costs ~2-3 ns an index to
        write and again to read, and on 2 x 4 ranks the node steps write and read
        about 1.4M indices a call per rank (``docs/cluster.md``, "Fixed indices
        inside the node"). Beyond paper 000, whose sec. 5.1 leaves the index coding
        open. The codec itself where the coding was named or a quantizer is set
        (its messages keep their coding and their generators)."""
        if self.index_coding != "auto" or self.quantizer is not None:
            return self
        return StreamCodec(None, self.quantize, self.sequence, "fixed", self.rank)

    def shared_seed(self, *parts: int) -> int:
        """A seed every rank derives alike from this call's number and ``parts``.

        (Not from the quantizer's own seed, which may differ between ranks.)
        """
        return hash((0x5EED, self.sequence, *parts))

    @property
    def lossy(self) -> bool:
        return self.quantizer is not None

    @property
    def quantizes_sums(self) -> bool:
        """Whether messages carrying partial sums may be quantized (not under Alg. 1)."""
        return self.quantizer is not None and self.quantize != "contributions"

    @property
    def quantizes_every_piece(self) -> bool:
        """Whether this rank's own contribution is quantized whatever its form
        (``"contributions"`` and ``"all"``), so its encoder picks sparse or dense."""
        return self.quantizer is not None and self.quantize != "dense"

    def _quantizes(self, stream: SparseStream, partial: bool) -> bool:
        if self.quantizer is None:
            return False
        if self.quantize == "contributions":
            return not partial
        return self.quantize == "all" or stream.is_dense

    def own_generator(self, device: torch.device) -> torch.Generator:
        """This rank's generator for this call: seeded by (quantizer seed, rank, call)."""
        if self._own_gen is None or self._own_gen.device != device:
            assert self.quantizer is not None
            base = self.quantizer.seed if self.quantizer.seed is not None else _PROCESS_SEED
            self._own_gen = torch.Generator(device=device)
            self._own_gen.manual_seed(hash((0x0A11, base, self.rank, self.sequence)) & (2**63 - 1))
        return self._own_gen

    def _generator(self, device: torch.device, shared_seed: int | None) -> torch.Generator:
        if shared_seed is None:
            return self.own_generator(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(shared_seed & (2**63 - 1))
        return gen

    def encode(
        self, stream: SparseStream, shared_seed: int | None = None, *, partial: bool = False
    ) -> torch.Tensor:
        """The message for ``stream`` (values quantized where the policy says so).

        ``partial``: the stream is a partial sum of several ranks' contributions,
        not this rank's own (exact under ``quantize="contributions"``).
        ``shared_seed``: ranks that hold the same stream and must send the same
        bytes (the two halves of a recursive-doubling group) quantize with a
        generator seeded by it instead of their own.
        """
        if self._quantizes(stream, partial):
            assert self.quantizer is not None
            gen = self._generator(stream.device, shared_seed)
            coding = self._quantized_coding(stream)
            return encode_quantized_stream(stream, self.quantizer, gen, coding)
        return self.encode_exact(stream)

    def _quantized_coding(self, stream: SparseStream) -> str:
        """The index coding of a quantized message (the module doc's list)."""
        if self.elias_fano(stream.device):
            return "elias-fano"
        return "delta" if self.index_coding == "delta" else "fixed"

    def quantize_own(self, stream: SparseStream) -> SparseStream:
        """Under ``"contributions"``: this rank's own contribution as it would be sent
        (quantized once, decoded), for the part of it that never leaves the rank."""
        if self.quantizer is None or self.quantize != "contributions":
            return stream
        if not stream.is_dense and stream.nnz == 0:
            return stream
        return self.decode(self.encode(stream), stream.size, stream.dtype, stream.device)

    def encode_exact(self, stream: SparseStream) -> torch.Tensor:
        """The exact encoding, for final results handed to other ranks (indices coded
        as ``index_coding`` says)."""
        return encode(stream, elias_fano=self.elias_fano(stream.device))

    def elias_fano(self, device: torch.device) -> bool:
        """Whether exact messages of streams on ``device`` may carry Elias--Fano indices."""
        if self.index_coding == "fixed":
            return False
        return self.index_coding == "elias-fano" or device.type == "cpu"

    def decode(
        self, buf: torch.Tensor, size: int | None, dtype: torch.dtype, device: torch.device
    ) -> SparseStream:
        """Decode a message of either kind, checking its size (unless None) and dtype."""
        if buf.numel() >= 3 and host_bytes(buf, 0, 3) == b"SpQ":
            if self.quantizer is None:
                raise WireFormatError("received a quantized message but no quantizer is set")
            s = decode_quantized_stream(buf, self.quantizer, dtype, device)
            if size is not None and s.size != size:
                raise WireFormatError(f"message holds a stream of size {s.size}, expected {size}")
            return s
        return decode(buf, expect_size=size, expect_dtype=dtype, device=device)

    def decode_concat(
        self,
        bufs: Sequence[torch.Tensor],
        sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        known: Mapping[int, SparseStream] | None = None,
    ) -> SparseStream:
        """Decode the messages of consecutive ranges into their concatenation: exact
        sparse messages straight into the result (:func:`~sparcml.wire.decode_concat`),
        anything else one by one, then :meth:`SparseStream.concat`. ``known``: ranges
        already held as the streams the messages decode to (not decoded again)."""
        known = known or {}
        quantized = (
            b.numel() >= 3 and host_bytes(b, 0, 3) == b"SpQ"
            for j, b in enumerate(bufs)
            if j not in known
        )
        if not any(quantized):
            out = decode_concat(bufs, sizes, dtype, device, known)
            if out is not None:
                return out
        parts = [
            known[j] if j in known else self.decode(b, n, dtype, device)
            for j, (b, n) in enumerate(zip(bufs, sizes, strict=True))
        ]
        return SparseStream.concat(parts)

    def roundtrip(
        self, stream: SparseStream, buf: torch.Tensor, *, partial: bool = False
    ) -> SparseStream:
        """What the receivers of ``buf`` will hold: the sender uses this copy too."""
        if not self._quantizes(stream, partial):
            return stream
        return self.decode(buf, stream.size, stream.dtype, stream.device)

    def encode_dense(self, values: torch.Tensor) -> torch.Tensor:
        """A dense vector's message (quantized if a quantizer is set)."""
        if self.quantizer is not None:
            return self.quantizer.quantize(values, self.own_generator(values.device))
        return as_bytes(values)

    def decode_dense(
        self, buf: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if self.quantizer is not None:
            out = self.quantizer.dequantize(buf, dtype, device)
        else:
            isize = dtype.itemsize
            if buf.numel() != n * isize:
                raise WireFormatError(f"dense message of {buf.numel()} bytes, expected {n * isize}")
            out = bytes_as(buf.to(device).clone(), dtype)
        if out.numel() != n:
            raise WireFormatError(f"dense message holds {out.numel()} values, expected {n}")
        return out


EXACT = StreamCodec()
