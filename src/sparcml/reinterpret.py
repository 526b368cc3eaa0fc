"""Reinterpreting tensors as bytes and back: the one place that does it.

Every wire format of the library (sparse streams, bundles, quantized payloads,
Ok-Topk's records) turns values and indices into ``uint8`` and back. Doing that
with ``tensor.view(dtype)`` directly has two traps that valid input hits:

* ``view`` between element sizes needs ``stride(-1) == 1`` literally, and
  ``tensor.contiguous()`` returns a one-element view with any stride unchanged
  (one element is "contiguous" whatever its stride): ``torch.arange(10)[3::5][:1]``;
* viewing bytes as a wider dtype needs the byte offset in the storage to be a
  multiple of the element size: a record cut out of a received buffer (one
  Ok-Topk survivor, an 8-byte index behind a 24-byte header in a bundle) is not.

:func:`as_bytes` and :func:`bytes_as` view when they can and copy only when they
must; :func:`index_low_bytes` / :func:`indices_from_low_bytes` are the ``c``-byte
index encoding every format shares (little-endian, the low ``c`` bytes of the
``int64``); :func:`pack_bools` / :func:`unpack_bools` the bit fields (eight flags
a byte, first flag in the lowest bit) of quantized payloads and of Elias--Fano
index fields. Pure tensor code: CPU or CUDA.
"""

from __future__ import annotations

import torch

__all__ = [
    "BOOL_SPREAD",
    "as_bytes",
    "bytes_as",
    "dense_1d",
    "index_low_bytes",
    "indices_from_low_bytes",
    "pack_bools",
    "sub_byte_table",
    "unpack_bools",
    "write_low_bytes",
]


def dense_1d(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened to 1-D with unit stride (a view when it already is one).

    Unlike ``contiguous()``, this also fixes the stride of zero- and one-element
    views, which ``view(dtype)`` checks.
    """
    t = t.reshape(-1)
    if t.stride(0) == 1:
        return t
    if t.numel() <= 1:
        # Same storage, same element: only the stride changes.
        return t.as_strided((t.numel(),), (1,))
    return t.contiguous()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in order, as a 1-D uint8 tensor.

    Example:
        >>> as_bytes(torch.tensor([1.0, 2.0, 3.0])[::2][1:]).tolist()
        [0, 0, 64, 64]
    """
    return dense_1d(t).view(torch.uint8)


def bytes_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D uint8 tensor read as ``dtype`` values (a view when aligned, else a copy).

    Raises:
        ValueError: the byte count is not a multiple of the element size.

    Example:
        >>> raw = torch.cat([torch.zeros(1, dtype=torch.uint8), as_bytes(torch.tensor([2.5]))])
        >>> bytes_as(raw[1:], torch.float32).tolist()  # byte offset 1: copied
        [2.5]
    """
    isize = dtype.itemsize
    buf = dense_1d(buf)
    if buf.numel() % isize:
        raise ValueError(f"{buf.numel()} bytes do not hold whole {dtype} values")
    if buf.storage_offset() % isize:
        buf = buf.clone()
    return buf.view(dtype)


def index_low_bytes(indices: torch.Tensor, c: int) -> torch.Tensor:
    """The low ``c`` bytes of each index (little-endian), flattened: the wire's index field.

    ``c`` is 1 to 8 (:func:`sparcml.stream.index_bytes`); a width that is not a
    machine word (3, 5, 6, 7) is one strided copy of the bytes.
    """
    words = as_bytes(indices.to(torch.int64)).reshape(-1, 8)
    return words[:, :c].reshape(-1) if c < 8 else words.reshape(-1)


def write_low_bytes(out: torch.Tensor, indices: torch.Tensor, c: int) -> None:
    """:func:`index_low_bytes` written into the uint8 tensor ``out`` (``c * n`` bytes) in
    one pass: a narrowing copy when ``c`` is a word width and ``out`` is aligned for it,
    else one strided copy of the low bytes."""
    word = _WORDS.get(c)
    if word is None or out.storage_offset() % c or out.stride(0) != 1:
        n = out.numel() // c
        low = as_bytes(indices.to(torch.int64)).reshape(-1, 8)[:, :c]
        out.as_strided((n, c), (c * out.stride(0), out.stride(0))).copy_(low)
    else:
        out.view(word).copy_(indices)


def indices_from_low_bytes(raw: torch.Tensor, c: int) -> torch.Tensor:
    """Inverse of :func:`index_low_bytes`: ``int64`` indices from ``c``-byte fields."""
    raw = dense_1d(raw)
    if c == 8:
        return bytes_as(raw, torch.int64)
    if c in _WORDS:
        # one widening pass from the unsigned c-byte words (a view when aligned)
        return bytes_as(raw, _WORDS[c]).to(torch.int64)
    # 3, 5, 6 or 7 bytes: each field into the low bytes of a zeroed int64
    n = raw.numel() // c
    wide = torch.zeros(n, 8, dtype=torch.uint8, device=raw.device)
    wide[:, :c] = raw.view(n, c)
    return wide.view(torch.int64).reshape(-1)


_WORDS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}


BOOL_SPREAD = 0x0102040810204080  # gathers the low bit of 8 bytes into the top byte


def pack_bools(flags: torch.Tensor) -> torch.Tensor:
    """Pack booleans (or 0/1 bytes) 8 per byte, first flag in the lowest bit.

    Multiplying the 8 bytes, read as one little-endian int64, by ``BOOL_SPREAD`` moves
    byte ``j``'s low bit to bit ``56 + j``: four tensor operations per 8 flags.

    Example:
        >>> pack_bools(torch.tensor([True, False, True])).tolist()
        [5]
    """
    n = flags.numel()
    f = flags.reshape(-1).to(torch.uint8)
    pad = (-n) % 8
    if pad:
        f = torch.cat([f, torch.zeros(pad, dtype=torch.uint8, device=f.device)])
    elif f.storage_offset() % 8 or f.stride(0) != 1:
        f = f.contiguous().clone()  # (an unaligned view of uint8 flags cannot be words)
    words = f.view(torch.int64)
    return ((words * BOOL_SPREAD) >> 56).to(torch.uint8)  # the low byte, sign extension dropped


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def sub_byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` int32: the ``bits``-bit codes held in each byte value,
    lowest bits first (``bits`` in 1, 2, 4): unpacking is one gather per byte."""
    key = (bits, device)
    table = _TABLES.get(key)
    if table is None:
        shifts = torch.arange(8 // bits, dtype=torch.int32) * bits
        table = (torch.arange(256, dtype=torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
        table = _TABLES.setdefault(key, table.to(device))
    return table


def unpack_bools(buf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bools`: the ``8 * len(buf)`` flags as 0/1 ``int32``."""
    return sub_byte_table(1, buf.device)[buf.long()].reshape(-1)
