"""Vectorised bit packing of small unsigned integer codes (no Python loops over elements).

* ``bits`` in {1, 2, 4, 8}: ``8 // bits`` codes per byte, ``ceil(n * bits / 8)`` bytes.
* any other ``bits`` <= 16: the low byte of every code when ``bits >= 8`` (``n``
  bytes), then one bit plane per remaining bit (``ceil(n / 8)`` bytes each).
  9 bits therefore take ``n + ceil(n/8) = ceil(9n/8)`` bytes, the size natural
  compression promises (paper 004, sec. 3.2).

Codes are little-endian within a byte (first code in the lowest bits).
"""

from __future__ import annotations

import torch

from ..errors import WireFormatError
from ..reinterpret import BOOL_SPREAD, pack_bools, sub_byte_table

__all__ = [
    "pack_bits",
    "pack_bits_into",
    "pack_bools",
    "pack_bools_into",
    "packed_nbytes",
    "unpack_bits",
]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes :func:`pack_bits` produces for ``n`` codes of ``bits`` bits."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must lie in [1, 16], got {bits}")
    if bits in (1, 2, 4, 8):
        return (n * bits + 7) // 8
    planes = bits - 8 if bits > 8 else bits
    return (n if bits > 8 else 0) + planes * ((n + 7) // 8)


def pack_bools_into(dst: torch.Tensor, flags: torch.Tensor) -> None:
    """:func:`pack_bools` writing into ``dst`` through scratch buffers (no allocation)."""
    from ._kernels import scratch

    n = flags.numel()
    width = dst.numel() * 8
    f = scratch("pack_flags", width, torch.uint8, flags.device)
    f[:n].copy_(flags.reshape(-1))
    f[n:].zero_()
    words = scratch("pack_words", width // 8, torch.int64, flags.device)
    torch.mul(f.view(torch.int64), BOOL_SPREAD, out=words)
    words >>= 56
    dst.copy_(words)  # the low byte of each word


def _pack_sub_byte(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 1:
        return pack_bools(codes)
    per = 8 // bits
    n = codes.numel()
    pad = (-n) % per
    c = codes.to(torch.uint8)
    if pad:
        c = torch.cat([c, torch.zeros(pad, dtype=torch.uint8, device=c.device)])
    c = c.reshape(-1, per)
    out = c[:, 0].clone()
    for j in range(1, per):  # at most 8 column passes, each vectorised
        out |= c[:, j] << (j * bits)
    return out


def _unpack_sub_byte(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The ``n`` int32 codes of a sub-byte packing: one table lookup per byte (a gather),
    instead of a shift-and-mask pass per code position and a stack."""
    return sub_byte_table(bits, buf.device)[buf.long()].reshape(-1)[:n]


def _pack_sub_byte_into(dst: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """:func:`_pack_sub_byte` writing into ``dst`` through scratch buffers (no allocation)."""
    from ._kernels import scratch

    per = 8 // bits
    n = codes.numel()
    rows = dst.numel()
    c = scratch("pack_codes", rows * per, torch.uint8, codes.device)
    c[:n].copy_(codes)
    c[n:].zero_()
    cols = c.view(rows, per)
    dst.copy_(cols[:, 0])
    tmp = scratch("pack_tmp", rows, torch.uint8, codes.device)
    for j in range(1, per):
        torch.bitwise_left_shift(cols[:, j], j * bits, out=tmp)
        dst |= tmp


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer ``codes`` (< 2**bits) into a uint8 tensor.

    Example:
        >>> pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist()
        [57]
    """
    n = codes.numel()
    codes = codes.reshape(-1)
    if bits in (1, 2, 4, 8):
        if bits == 8:
            return codes.to(torch.uint8)
        return _pack_sub_byte(codes, bits)
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must lie in [1, 16], got {bits}")
    codes = codes.to(torch.int32)
    parts = []
    shift = 0
    if bits > 8:
        parts.append((codes & 0xFF).to(torch.uint8))
        shift = 8
    for j in range(shift, bits):
        parts.append(_pack_sub_byte((codes >> j) & 1, 1))
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=codes.device)
    assert out.numel() == packed_nbytes(n, bits)
    return out


def unpack_bits(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes as int32.

    Raises:
        ValueError: ``buf`` has the wrong length for ``n`` codes of ``bits`` bits.
    """
    need = packed_nbytes(n, bits)
    if buf.numel() != need:
        raise ValueError(f"packed buffer has {buf.numel()} bytes, {n} {bits}-bit codes need {need}")
    if bits in (1, 2, 4):
        return _unpack_sub_byte(buf, n, bits)
    if bits == 8:
        return buf.to(torch.int32)
    out = torch.zeros(n, dtype=torch.int32, device=buf.device)
    offset = 0
    shift = 0
    if bits > 8:
        out |= buf[:n].to(torch.int32)
        offset, shift = n, 8
    plane = (n + 7) // 8
    for j in range(shift, bits):
        bitsj = _unpack_sub_byte(buf[offset : offset + plane], n, 1).to(torch.int32)
        out |= bitsj << j
        offset += plane
    return out


def pack_bits_into(out: torch.Tensor, codes: torch.Tensor, n: int, lo: int, bits: int) -> None:
    """Write the codes of elements ``[lo, lo + len(codes))`` of an ``n``-code message.

    ``out`` is the whole :func:`pack_bits` buffer (``packed_nbytes(n, bits)``
    bytes); ``lo`` must be a multiple of 8. Lets a chunked quantizer pack as it goes
    with the same layout as :func:`pack_bits` of the whole message.
    """
    if lo % 8:
        raise ValueError(f"chunks must start at a multiple of 8, got {lo}")
    m = codes.numel()
    if bits in (1, 2, 4, 8):
        start = lo * bits // 8
        dst = out[start : start + packed_nbytes(m, bits)]
        if bits == 8:
            dst.copy_(codes.reshape(-1))
        elif bits == 1:
            pack_bools_into(dst, codes)
        else:
            _pack_sub_byte_into(dst, codes.reshape(-1), bits)
        return
    codes = codes.reshape(-1).to(torch.int32)
    plane = (n + 7) // 8
    offset, first = 0, 0
    if bits > 8:
        out[lo : lo + m] = (codes & 0xFF).to(torch.uint8)
        offset, first = n, 8
    for j in range(first, bits):
        base = offset + (j - first) * plane + lo // 8
        out[base : base + (m + 7) // 8] = pack_bools((codes >> j) & 1)


def _varint_lengths(values: torch.Tensor) -> torch.Tensor:
    """Bytes of each non-negative int64 in base-128 (LEB128): 1 + floor(bits / 7)."""
    nb = torch.ones_like(values)
    for t in range(1, 9):  # 9 bytes hold any index below 2^63
        nb += (values >= (1 << (7 * t))).to(values.dtype)
    return nb


def encode_index_deltas(indices: torch.Tensor) -> torch.Tensor:
    """Sorted indices as LEB128 varints of their gaps (the first index as is).

    At density ``d`` with spread indices the gaps are about ``1/d``: one byte
    per index below ``d = 1/128``, two up to ``1/16384``, against ``c = 4`` bytes
    fixed for ``N > 65536``. Vectorised: every byte is computed at once.

    Example:
        >>> encode_index_deltas(torch.tensor([3, 5, 300])).tolist()
        [3, 2, 167, 2]
    """
    if indices.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=indices.device)
    gaps = indices.to(torch.int64).clone()
    gaps[1:] -= indices[:-1].to(torch.int64)
    nb = _varint_lengths(gaps)
    total = int(nb.sum())
    group = torch.repeat_interleave(torch.arange(gaps.numel(), device=gaps.device), nb)
    starts = torch.cumsum(nb, 0) - nb
    j = torch.arange(total, device=gaps.device) - starts[group]
    byte = (gaps[group] >> (7 * j)) & 0x7F
    more = j < (nb[group] - 1)
    return (byte | (more.to(torch.int64) << 7)).to(torch.uint8)


def decode_index_deltas(buf: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`encode_index_deltas`: ``count`` indices from the front of ``buf``.

    Returns:
        The int64 indices and the number of bytes they took.

    Raises:
        WireFormatError: fewer than ``count`` varints, an overlong varint, or
            gaps that do not increase strictly.
    """
    device = buf.device
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=device), 0
    last = (buf & 0x80) == 0
    ends = torch.nonzero(last).reshape(-1)
    if ends.numel() < count:
        raise WireFormatError(f"index varints: {ends.numel()} found, {count} expected")
    length = int(ends[count - 1]) + 1
    body = buf[:length].to(torch.int64)
    term = last[:length].to(torch.int64)
    group = torch.cumsum(term, 0) - term
    starts = torch.zeros(count, dtype=torch.int64, device=device)
    starts[1:] = ends[: count - 1] + 1
    j = torch.arange(length, device=device) - starts[group]
    if int(j.max()) > 8:
        raise WireFormatError("index varints: an index longer than 9 bytes")
    gaps = torch.zeros(count, dtype=torch.int64, device=device)
    gaps.scatter_add_(0, group, (body & 0x7F) << (7 * j))
    if count > 1 and bool((gaps[1:] <= 0).any()):
        raise WireFormatError("index varints: indices are not strictly increasing")
    return torch.cumsum(gaps, 0), length
