"""How the collectives put sparse streams on the wire, with or without value quantization.

SparCML quantizes "the dense stream" of the reduction (paper 000, sec. 6): the
second phase of ``dsar_split_allgather``, where the reduced ranges are dense,
with QSGD. A :class:`StreamCodec` holds that choice for one collective call:

* no quantizer: every message is the exact wire encoding (:mod:`sparcml.wire`);
* ``quantize="dense"`` (default with a quantizer): messages carrying a *dense*
  stream (DSAR's phase 2, any partial sum past ``delta``) have their values
  quantized; sparse messages stay exact;
* ``quantize="all"``: every message's values are quantized (the caller's
  choice for the sparse phases, e.g. ``topk+qsgd``).

Results stay bitwise identical on every rank: a quantized message is decoded
from its bytes by every rank that uses it, the sender included, and final
results are handed on exactly (:meth:`encode_exact`).
"""

from __future__ import annotations

import torch

from ..compress.base import Quantizer, decode_quantized_stream, encode_quantized_stream
from ..errors import WireFormatError
from ..stream import SparseStream
from ..wire import decode, encode

__all__ = ["EXACT", "StreamCodec"]


class StreamCodec:
    """Encoder/decoder of the streams a collective sends (see the module docstring).

    Args:
        quantizer: a value quantizer (``sparcml.compress.get("qsgd", bits=4)``), or None.
        quantize: ``"dense"`` or ``"all"``.
        index_coding: indices of quantized sparse messages as ``c``-byte words
            (``"fixed"``) or varints of their gaps (``"delta"``); exact messages
            keep the fixed format.
    """

    def __init__(
        self,
        quantizer: Quantizer | None = None,
        quantize: str = "dense",
        sequence: int = 0,
        index_coding: str = "fixed",
    ) -> None:
        if quantizer is not None and not isinstance(quantizer, Quantizer):
            raise TypeError(
                f"quantizer must be a value quantizer such as sparcml.compress.get('qsgd'), "
                f"got {type(quantizer).__name__}"
            )
        if quantize not in ("dense", "all"):
            raise ValueError(f"quantize must be 'dense' or 'all', got {quantize!r}")
        if index_coding not in ("fixed", "delta"):
            raise ValueError(f"index_coding must be 'fixed' or 'delta', got {index_coding!r}")
        self.quantizer = quantizer
        self.quantize = quantize
        self.index_coding = index_coding
        self.sequence = sequence  # the collective call's number, equal on every rank

    def shared_seed(self, *parts: int) -> int:
        """A seed every rank derives alike from this call's number and ``parts``.

        (Not from the quantizer's own seed, which may differ between ranks.)
        """
        return hash((0x5EED, self.sequence, *parts))

    @property
    def lossy(self) -> bool:
        return self.quantizer is not None

    def _quantizes(self, stream: SparseStream) -> bool:
        return self.quantizer is not None and (self.quantize == "all" or stream.is_dense)

    def encode(self, stream: SparseStream, shared_seed: int | None = None) -> torch.Tensor:
        """The message for ``stream`` (values quantized where the policy says so).

        ``shared_seed``: ranks that hold the same stream and must send the same
        bytes (the two halves of a recursive-doubling group) quantize with a
        generator seeded by it instead of their own.
        """
        if self._quantizes(stream):
            assert self.quantizer is not None
            gen = None
            if shared_seed is not None:
                gen = torch.Generator(device=stream.device)
                gen.manual_seed(shared_seed & (2**63 - 1))
            return encode_quantized_stream(stream, self.quantizer, gen, self.index_coding)
        return encode(stream)

    @staticmethod
    def encode_exact(stream: SparseStream) -> torch.Tensor:
        """The exact encoding, for final results handed to other ranks."""
        return encode(stream)

    def decode(
        self, buf: torch.Tensor, size: int | None, dtype: torch.dtype, device: torch.device
    ) -> SparseStream:
        """Decode a message of either kind, checking its size (unless None) and dtype."""
        if buf.numel() >= 3 and bytes(buf[:3].tolist()) == b"SpQ":
            if self.quantizer is None:
                raise WireFormatError("received a quantized message but no quantizer is set")
            s = decode_quantized_stream(buf, self.quantizer, dtype, device)
            if size is not None and s.size != size:
                raise WireFormatError(f"message holds a stream of size {s.size}, expected {size}")
            return s
        return decode(buf, expect_size=size, expect_dtype=dtype, device=device)

    def roundtrip(self, stream: SparseStream, buf: torch.Tensor) -> SparseStream:
        """What the receivers of ``buf`` will hold: the sender uses this copy too."""
        if not self._quantizes(stream):
            return stream
        return self.decode(buf, stream.size, stream.dtype, stream.device)

    def encode_dense(self, values: torch.Tensor) -> torch.Tensor:
        """A dense vector's message (quantized if a quantizer is set)."""
        if self.quantizer is not None:
            return self.quantizer.quantize(values)
        return values.contiguous().view(torch.uint8)

    def decode_dense(
        self, buf: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if self.quantizer is not None:
            out = self.quantizer.dequantize(buf, dtype, device)
        else:
            isize = torch.empty((), dtype=dtype).element_size()
            if buf.numel() != n * isize:
                raise WireFormatError(f"dense message of {buf.numel()} bytes, expected {n * isize}")
            out = buf.to(device).clone().view(dtype)
        if out.numel() != n:
            raise WireFormatError(f"dense message holds {out.numel()} values, expected {n}")
        return out


EXACT = StreamCodec()
