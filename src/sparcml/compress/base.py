"""The compressor contract, the registry and composition.

Contract (docs/ARCHITECTURE.md, "Compression"): ``compress(t) -> (payload,
ctx)``; only the payload (a 1-D uint8 tensor) travels, ``ctx`` stays local;
``decompress(payload, ctx)`` gives a tensor of ``t``'s shape and dtype. A
receiver decompresses a peer's payload with its *own* ctx (same shape on every
rank): every payload therefore describes its
own length, starting with a 16-byte header::

    magic b"SpQ" | version | operator code | flags | 2 reserved | n (uint64)

Two families:

* :class:`Selector` — picks entries (``select(t) -> SparseStream``); payload: the
  header, then the stream's wire encoding (:mod:`sparcml.wire`).
* :class:`Quantizer` — lowers the precision of every value
  (``quantize(values) -> payload``, ``dequantize(payload, dtype, device)``).

``Composed(selector, quantizer)`` selects, then quantizes the selected values
(``get("topk+natural", density=0.01)``): header, nnz, the indices with ``c``
bytes each, then the quantizer's payload of the values.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import struct
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..errors import WireFormatError
from ..finite import all_finite
from ..indexcode import (
    ELIAS_FANO,
    MAX_LOW_BITS,
    IndexLayout,
    elias_fano_nbytes,
    layout,
    read_elias_fano_checked,
    write_elias_fano,
)
from ..reinterpret import dense_1d, index_low_bytes, indices_from_low_bytes
from ..stream import SUPPORTED_DTYPES, SparseStream, index_bytes
from ..wire import check_indices, host_bytes
from .packing import decode_index_deltas, encode_index_deltas

__all__ = [
    "FLOAT32_MAX",
    "Composed",
    "Compressor",
    "Context",
    "Quantizer",
    "Selector",
    "accepted_params",
    "available",
    "check_kind",
    "get",
    "operator_class",
    "register",
    "selector_and_quantizer",
    "split_composition",
    "to_saturating",
]

_MAGIC = b"SpQ"
_VERSION = 2  # 2: fixed-width indices of index_bytes(N) = ceil(log2(N) / 8) bytes
_HEADER = struct.Struct("<3sBBBHQ")
HEADER_BYTES = _HEADER.size  # 16
QUANTIZED_STREAM_CODE = 7


@dataclasses.dataclass(frozen=True)
class Context:
    """What stays local: the original shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Context:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def make_header(
    code: int, n: int, flags: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The 16-byte payload header as a uint8 tensor."""
    raw = _HEADER.pack(_MAGIC, _VERSION, code, flags, 0, n)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


_INT64 = struct.Struct("<q")


def read_header(payload: torch.Tensor, code: int, what: str) -> tuple[int, int, torch.Tensor]:
    """Check a payload header; return ``(n, flags, body)``.

    Raises:
        WireFormatError: not a payload of operator ``what``.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise WireFormatError(f"{what}: a payload must be a 1-D uint8 tensor")
    if payload.numel() < HEADER_BYTES:
        raise WireFormatError(f"{what}: truncated payload ({payload.numel()} bytes)")
    magic, version, got, flags, reserved, n = _HEADER.unpack(host_bytes(payload, 0, HEADER_BYTES))
    if magic != _MAGIC or version != _VERSION or reserved:
        raise WireFormatError(f"{what}: not a compressed payload of this version")
    if got != code:
        raise WireFormatError(f"{what}: payload was produced by operator code {got}, not {code}")
    return n, flags, payload[HEADER_BYTES:]


def check_input(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Validate a tensor handed to an operator; return it flattened."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what} compresses float32, float16, bfloat16 or float64 tensors, got {tensor.dtype}"
        )
    return dense_1d(tensor.detach())


#: float32's largest finite value (the quantizers' scales travel as float32)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def to_saturating(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float32 or float64, finite) in ``dtype``, magnitudes beyond its
    largest finite value kept at that value instead of becoming Inf.

    For natural compression: it rounds float16 values above 2^15 to 2^16 (Inf in
    float16) with the probability that keeps them unbiased; saturating at 65504
    biases those entries by at most 32 (0.05% of 60,000) where Inf would poison the
    sum. (Not for QSGD or dithering: their levels are multiples of a norm that may
    lie far beyond the dtype's range, and saturating would bias them heavily; their
    Inf stays a visible failure.)"""
    if dtype == values.dtype or not dtype.is_floating_point:
        return values.to(dtype)
    top = torch.finfo(dtype).max
    if top >= torch.finfo(values.dtype).max:
        return values.to(dtype)
    return values.clamp(-top, top).to(dtype)


def check_finite(values: torch.Tensor, what: str) -> None:
    """Quantizers cannot represent NaN/Inf: refuse them instead of corrupting the result."""
    if not all_finite(values):
        bad = int((~torch.isfinite(values)).nonzero()[0])
        raise ValueError(
            f"{what}: non-finite value {values[bad].item()} at flat index {bad}; quantizers "
            "need finite input (check the gradients, or pass check_finite=False to map "
            "them as documented)"
        )


class Compressor(abc.ABC):
    """Base of every operator. ``summable``: payloads may be added without decompressing."""

    name: ClassVar[str] = ""
    code: ClassVar[int] = 0
    summable: ClassVar[bool] = False

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """``(payload, ctx)``: the payload travels, ``ctx`` stays local."""

    @abc.abstractmethod
    def decompress(self, payload: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The (approximate) tensor, with ``ctx``'s shape, dtype and device."""

    @staticmethod
    def payload_nbytes(payload: torch.Tensor) -> int:
        """Bytes on the wire."""
        return payload.numel()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"

    def params(self) -> dict[str, Any]:
        """The hyperparameters this operator was built with."""
        return {k: getattr(self, k) for k in _init_names(type(self)) if hasattr(self, k)}


def accepted_params(name: str) -> set[str]:
    """The hyperparameters the operator (or ``selector+quantizer`` composition)
    registered as ``name`` takes; empty for an unknown name."""
    out: set[str] = set()
    for part in split_composition(name):
        cls = _REGISTRY.get(part) if part is not None else None
        if cls is not None:
            out.update(_init_names(cls))
    return out


@functools.cache
def _init_names(cls: type) -> tuple[str, ...]:
    """The constructor's parameter names of an operator class (``inspect.signature``
    once per class: every collective call with a quantizer reads them for its
    consistency header)."""
    return tuple(k for k in inspect.signature(cls.__init__).parameters if k != "self")


class Quantizer(Compressor):
    """Lowers the precision of every value; any selector may be followed by one.

    A quantizer with a ``seed`` attribute draws from one generator per device,
    seeded with it (``seed = None``: torch's default, nondeterministic generator).
    """

    seed: int | None = None

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        gens: dict[torch.device, torch.Generator] = self.__dict__.setdefault("_gens", {})
        g = gens.get(device)
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.seed)
            gens[device] = g
        return g

    @abc.abstractmethod
    def quantize(
        self, values: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Payload (header included) of a 1-D float tensor.

        ``generator`` overrides the operator's own random generator for this call
        (the collectives pass one seeded alike on ranks that must agree).
        """

    @abc.abstractmethod
    def dequantize(
        self, payload: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The 1-D values a payload holds."""

    @abc.abstractmethod
    def expected_nbytes(self, n: int) -> int:
        """Payload size for ``n`` values (the format's formula)."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        ctx = Context.of(tensor)
        return self.quantize(check_input(tensor, self.name)), ctx

    def decompress(self, payload: torch.Tensor, ctx: Context) -> torch.Tensor:
        values = self.dequantize(payload, ctx.dtype, ctx.device)
        if values.numel() != ctx.numel:
            raise WireFormatError(
                f"{self.name}: payload holds {values.numel()} values, the local tensor has "
                f"{ctx.numel}"
            )
        return values.reshape(ctx.shape)


class Selector(Compressor):
    """Picks entries of a tensor: ``select(t)`` is a :class:`SparseStream` of ``t.numel()``."""

    code = 6
    #: ``select`` keeps nothing between calls (no threshold, no random stream): a
    #: selection the caller then throws away changes no later one
    stateless: ClassVar[bool] = False

    @abc.abstractmethod
    def select(self, tensor: torch.Tensor) -> SparseStream:
        """The selected entries, exact values, as a sparse stream over the flattened tensor."""

    def select_covering(self, tensor: torch.Tensor) -> tuple[SparseStream, bool]:
        """:meth:`select`, and whether the selection holds every non-zero of
        ``tensor``: then ``tensor`` minus the selection is zero, and error feedback
        knows its residual is zero without reading it (beyond the papers: a
        sparse-feature gradient with fewer non-zeros than ``k`` leaves no residual).
        False unless the selector knows it without another pass (this default)."""
        return self.select(tensor), False

    def select_checked(self, tensor: torch.Tensor) -> tuple[SparseStream, bool, bool | None]:
        """:meth:`select_covering`, and whether ``tensor`` holds no NaN or +-inf, where
        the selection learns it without another pass (None otherwise: this default;
        the caller then reads ``tensor`` for them)."""
        return *self.select_covering(tensor), None

    def takes_all_nonzeros(self, nonzeros: int, numel: int) -> bool:
        """Whether a tensor of ``numel`` entries with at most ``nonzeros`` non-zeros
        would have every one of them selected (a top-k below ``k``): its selection is
        then the tensor itself, which an exact reduction sends without densifying it
        (beyond the papers: a sparse gradient). False unless the selector knows."""
        return False

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        from ..wire import encode

        ctx = Context.of(tensor)
        stream = self.select(tensor)
        return torch.cat(
            [make_header(self.code, stream.size, device=stream.device), encode(stream)]
        ), ctx

    def decompress(self, payload: torch.Tensor, ctx: Context) -> torch.Tensor:
        from ..wire import decode

        _n, _, body = read_header(payload, self.code, self.name)
        stream = decode(body, expect_size=ctx.numel, expect_dtype=ctx.dtype, device=ctx.device)
        return stream.to_dense().reshape(ctx.shape)


class Composed(Compressor):
    """A selector followed by a value quantizer (paper 004 sec. 3.3, Thm 3; paper 000 Alg. 1)."""

    code = QUANTIZED_STREAM_CODE

    def __init__(self, selector: Selector, quantizer: Quantizer) -> None:
        if not isinstance(selector, Selector) or not isinstance(quantizer, Quantizer):
            raise TypeError("compose a Selector with a Quantizer, e.g. get('topk+natural', ...)")
        self.selector = selector
        self.quantizer = quantizer
        self.name = f"{selector.name}+{quantizer.name}"  # type: ignore[misc]

    def params(self) -> dict[str, Any]:
        return {**self.selector.params(), **self.quantizer.params()}

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        ctx = Context.of(tensor)
        stream = self.selector.select(tensor)
        return self.encode_stream(stream), ctx

    def encode_stream(self, stream: SparseStream) -> torch.Tensor:
        """Payload of an already selected stream: indices, then quantized values."""
        return encode_quantized_stream(stream, self.quantizer)

    def decode_stream(
        self, payload: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> SparseStream:
        """The stream a payload describes, with dequantized values."""
        return decode_quantized_stream(payload, self.quantizer, dtype, device)

    def decompress(self, payload: torch.Tensor, ctx: Context) -> torch.Tensor:
        stream = self.decode_stream(payload, ctx.dtype, ctx.device)
        if stream.size != ctx.numel:
            raise WireFormatError(f"{self.name}: payload of size {stream.size}, local {ctx.numel}")
        return stream.to_dense().reshape(ctx.shape)


def selector_and_quantizer(op: Compressor) -> tuple[Selector, Quantizer | None]:
    """The selector of a selector method's operator and its value quantizer (None
    for a plain selector): ``topk`` gives ``(TopK, None)``, ``topk+natural`` the
    two parts of its :class:`Composed`."""
    if isinstance(op, Composed):
        return op.selector, op.quantizer
    assert isinstance(op, Selector), f"{op.name} is not a selector"
    return op, None


#: header flags of a quantized stream: dense values; varint gaps; Elias--Fano indices
_Q_DENSE, _Q_DELTA, _Q_ELIAS_FANO = 1, 2, 4
#: the index codings a quantized stream may be asked for
QUANTIZED_INDEX_CODINGS = ("fixed", "delta", "elias-fano")


def encode_quantized_stream(
    stream: SparseStream,
    quantizer: Quantizer,
    generator: torch.Generator | None = None,
    index_coding: str = "fixed",
) -> torch.Tensor:
    """A sparse stream with quantized values: header, nnz, indices, values payload.

    Indices are ``c`` bytes each (``index_coding="fixed"``), LEB128 varints of
    their gaps (``"delta"``, header flag 2: about 1.3 bytes at 1% density; see
    :func:`~sparcml.compress.packing.encode_index_deltas`), or, with
    ``"elias-fano"``, an Elias--Fano field (:mod:`sparcml.indexcode`, header flag 4:
    a word holding its low bits ``l``, then the field; about ``l + 2`` bits an index,
    ``l = floor(log2(N / nnz))``, and one compiled pass each way on the CPU) where it
    is smaller than the fixed fields, else the fixed fields (beyond the paper, as
    for exact messages). The smaller form is sent (sec. 5.1's ``delta`` with the
    quantized value size in place of ``isize``: at 9-bit natural compression and
    3-byte indices, pairs below 27% density; delta-coded indices counted at their
    least, a byte each): the dense form is the header (flag 1) and the quantized
    vector, and a dense stream with enough zeros goes as pairs (one counting pass
    decides). Zeros quantize to zeros, so either form holds the same vector.
    """
    if index_coding not in QUANTIZED_INDEX_CODINGS:
        raise ValueError(
            f"index_coding must be one of {', '.join(map(repr, QUANTIZED_INDEX_CODINGS))}, "
            f"got {index_coding!r}"
        )
    device = stream.device
    n = stream.size

    def elias_fano(nnz: int) -> IndexLayout | None:
        """The Elias--Fano field, where it and its low bits' word take fewer bytes
        than the fixed fields."""
        if index_coding != "elias-fano":
            return None
        fields = layout(n, nnz)
        fits = fields.coding == ELIAS_FANO and 8 + fields.nbytes < nnz * index_bytes(n)
        return fields if fits else None

    def index_nbytes(nnz: int) -> int:
        if index_coding == "delta":
            return nnz
        fields = elias_fano(nnz)
        return nnz * index_bytes(n) if fields is None else 8 + fields.nbytes

    def sparse_is_smaller(nnz: int) -> bool:
        return index_nbytes(nnz) + quantizer.expected_nbytes(nnz) < quantizer.expected_nbytes(n)

    if stream.is_dense:
        # a dense stream (a split piece of a dense gradient, say) with enough zeros
        # goes as pairs: one counting pass decides
        if sparse_is_smaller(int(torch.count_nonzero(stream.values))):
            idx = torch.nonzero(stream.values).flatten()
            stream = SparseStream.from_sorted(idx, stream.values[idx], n)
    elif stream.nnz and not sparse_is_smaller(stream.nnz):
        stream = SparseStream.dense(stream.to_dense())
    if stream.is_dense:
        parts = [make_header(QUANTIZED_STREAM_CODE, n, flags=_Q_DENSE, device=device)]
    else:
        nnz = torch.frombuffer(bytearray(_INT64.pack(stream.nnz)), dtype=torch.uint8).to(device)
        fields = None if index_coding == "delta" else elias_fano(stream.nnz)
        if index_coding == "delta":
            idx = encode_index_deltas(stream.indices)
            flags = _Q_DELTA
        elif fields is not None:
            field = torch.empty(8 + fields.nbytes, dtype=torch.uint8, device=device)
            field[:8].view(torch.int64).fill_(fields.width)
            write_elias_fano(field[8:], stream.indices, n, fields.width)
            idx, flags = field, _Q_ELIAS_FANO
        else:
            idx = index_low_bytes(stream.indices, index_bytes(n))
            flags = 0
        parts = [make_header(QUANTIZED_STREAM_CODE, n, flags=flags, device=device), nnz, idx]
    parts.append(quantizer.quantize(stream.values, generator))
    return torch.cat(parts)


def decode_quantized_stream(
    payload: torch.Tensor, quantizer: Quantizer, dtype: torch.dtype, device: torch.device
) -> SparseStream:
    """Inverse of :func:`encode_quantized_stream` (values dequantized).

    Raises:
        WireFormatError: malformed payload.
    """
    what = f"stream with {quantizer.name} values"
    n, flags, body = read_header(payload, QUANTIZED_STREAM_CODE, what)
    if n >= 1 << 63:  # (an int64 index could not address it)
        raise WireFormatError(f"{what}: malformed payload (size {n})")
    if flags not in (0, _Q_DENSE, _Q_DELTA, _Q_ELIAS_FANO):
        raise WireFormatError(f"{what}: unknown flags {flags:#x}")
    if flags & _Q_DENSE:
        values = quantizer.dequantize(body, dtype, device)
        if values.numel() != n:
            raise WireFormatError(f"{what}: dense payload holds {values.numel()} of {n} values")
        return SparseStream.dense(values)
    if body.numel() < 8:
        raise WireFormatError(f"{what}: truncated payload")
    (nnz,) = _INT64.unpack(host_bytes(body, 0, 8))
    if nnz < 0 or nnz > n:
        raise WireFormatError(f"{what}: malformed payload (nnz={nnz}, n={n})")
    if flags & _Q_DELTA:
        indices, used = decode_index_deltas(body[8:].to(device), nnz)
        check_indices(indices, n, what)
        used += 8
    elif flags & _Q_ELIAS_FANO:
        low_bits = _INT64.unpack(host_bytes(body, 8, 8))[0] if body.numel() >= 16 else -1
        if not 0 <= low_bits <= MAX_LOW_BITS:
            raise WireFormatError(f"{what}: malformed payload (Elias-Fano low bits {low_bits})")
        used = 16 + elias_fano_nbytes(n, nnz, low_bits)
        # (the values' bytes checked first: a field of about nnz/4 bytes must not
        # make this rank allocate nnz indices for a message too short to hold them)
        if body.numel() < used + quantizer.expected_nbytes(nnz):
            raise WireFormatError(f"{what}: truncated Elias-Fano index field or values")
        indices = torch.empty(nnz, dtype=torch.int64, device=device)
        read_elias_fano_checked(body[16:used].to(device), n, low_bits, indices, what=what)
    else:
        c = index_bytes(n)
        used = 8 + nnz * c
        if body.numel() < used:
            raise WireFormatError(f"{what}: malformed payload (nnz={nnz}, n={n})")
        indices = indices_from_low_bytes(body[8:used].to(device), c)
        check_indices(indices, n, what)
    values = quantizer.dequantize(body[used:], dtype, device)
    if values.numel() != nnz:
        raise WireFormatError(f"{what}: {values.numel()} values for {nnz} indices")
    return SparseStream.from_sorted(indices, _values_of(values, dtype), n)


def _values_of(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoder's values as the stream's dtype, 1-D with unit stride."""
    return dense_1d(values.to(dtype))


_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str) -> Callable[[type[Compressor]], type[Compressor]]:
    """Class decorator: make an operator available to :func:`get` under ``name``."""

    def deco(cls: type[Compressor]) -> type[Compressor]:
        if name in _REGISTRY:
            raise ValueError(f"a compressor named {name!r} is already registered")
        cls.name = name  # type: ignore[misc]
        _REGISTRY[name] = cls
        return cls

    return deco


def operator_class(name: str) -> type[Compressor] | None:
    """The class registered as ``name`` (None if there is none)."""
    return _REGISTRY.get(name)


def available() -> dict[str, str]:
    """Registered operator names and their kind (selector / quantizer / operator)."""
    out = {}
    for name, cls in sorted(_REGISTRY.items()):
        kind = (
            "selector"
            if issubclass(cls, Selector)
            else "quantizer"
            if issubclass(cls, Quantizer)
            else "operator"
        )
        out[name] = kind
    return out


def _build(name: str, params: dict[str, Any], used: set[str]) -> Compressor:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown compressor {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None
    takes = _init_names(cls)
    mine = {k: v for k, v in params.items() if k in takes}
    used.update(mine)
    return cls(**mine)


def check_kind(name: str, kind: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a registered operator of ``kind``
    (``"selector"`` or ``"quantizer"``), listing the ones that are."""
    kinds = available()
    if kinds.get(name) != kind:
        those = ", ".join(n for n, k in kinds.items() if k == kind)
        raise ValueError(f"{name!r} is not a {kind}; {kind}s: {those}")


def split_composition(name: str) -> tuple[str, str | None]:
    """``(selector_or_quantizer, quantizer)`` of an operator name: ``"topk"`` ->
    ``("topk", None)``, ``"topk+natural"`` -> ``("topk", "natural")``. The one
    parser of the ``"selector+quantizer"`` form (operators, training methods, the
    command line); it checks the form, not the names.

    Raises:
        ValueError: more than one ``+``, or an empty part.
    """
    parts = [p.strip() for p in name.split("+")]
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"compose at most one selector and one quantizer, got {name!r}")
    return parts[0], (parts[1] if len(parts) == 2 else None)


def get(name: str, **params: Any) -> Compressor:
    """Build an operator by name; ``"selector+quantizer"`` composes two.

    Args:
        name: a registered name (see :func:`available`) or ``"a+b"``.
        **params: hyperparameters; each goes to the operator whose constructor names it.

    Raises:
        ValueError: unknown name, a parameter no operator takes, or an invalid value.

    Example:
        >>> op = get("topk+natural", density=0.01)
        >>> payload, ctx = op.compress(torch.randn(1000))
        >>> op.decompress(payload, ctx).count_nonzero().item() <= 10
        True
    """
    used: set[str] = set()
    first, second = split_composition(name)
    if second is None:
        op = _build(first, params, used)
    else:
        sel = _build(first, params, used)
        quant = _build(second, params, used)
        if not isinstance(sel, Selector):
            raise ValueError(f"{first!r} is not a selector; compose as 'selector+quantizer'")
        if not isinstance(quant, Quantizer):
            raise ValueError(f"{second!r} is not a value quantizer")
        op = Composed(sel, quant)
    unknown = sorted(set(params) - used)
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {', '.join(unknown)}")
    return op
