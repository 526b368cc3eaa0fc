"""Shared test helpers: seeded sparse inputs with the index patterns the issue names."""

from __future__ import annotations

import torch

from sparcml import SparseStream

PATTERNS = ("random", "overlap", "disjoint", "identical", "skewed", "empty", "dense")


def make_stream(
    pattern: str,
    rank: int,
    world: int,
    size: int,
    dtype: torch.dtype = torch.float32,
    *,
    integer: bool = True,
    seed: int = 0,
    density: float = 0.1,
) -> SparseStream:
    """This rank's input for ``pattern``; integer-valued floats make sums exact.

    * random: each rank its own uniform random set, k varying per rank (0 included);
    * overlap: every rank draws from one shared pool of about 2k indices;
    * disjoint: rank r holds indices congruent to r modulo P;
    * identical: every rank holds the same index set;
    * skewed: all non-zeros on rank 0, the other ranks empty;
    * empty: no non-zeros anywhere;
    * dense: about 60 percent density, forcing the dense switch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + size)
    shared = torch.Generator().manual_seed(seed * 31 + size)
    k = max(1, int(size * density))
    if pattern == "random":
        k_r = (k * (rank % 3)) // 2  # 0, k/2, k, 0, ...
        idx = torch.randperm(size, generator=g)[:k_r]
    elif pattern == "overlap":
        pool = torch.randperm(size, generator=shared)[: min(size, 2 * k)]
        idx = pool[torch.randperm(pool.numel(), generator=g)[:k]]
    elif pattern == "disjoint":
        idx = torch.arange(rank, max(size, rank), world)[:k]
    elif pattern == "identical":
        idx = torch.randperm(size, generator=shared)[:k]
    elif pattern == "skewed":
        idx = torch.randperm(size, generator=g)[: 3 * k] if rank == 0 else torch.empty(0)
    elif pattern == "empty":
        idx = torch.empty(0)
    elif pattern == "dense":
        idx = torch.randperm(size, generator=g)[: (size * 6) // 10]
    else:
        raise ValueError(pattern)
    idx = idx.to(torch.int64)
    if integer:
        vals = torch.randint(-4, 5, (idx.numel(),), generator=g).to(dtype)
    else:
        vals = torch.randn(idx.numel(), generator=g, dtype=torch.float64).to(dtype)
    return SparseStream(idx, vals, size)


def dense_reference(streams: list[SparseStream]) -> torch.Tensor:
    """The sum over ranks, computed densely in float64."""
    return torch.stack([s.to_dense().to(torch.float64) for s in streams]).sum(0)


def decode_corrupted(
    buf: torch.Tensor, pos: int, junk: bytes
) -> tuple[torch.Tensor, SparseStream | None]:
    """``buf`` with ``junk`` written from ``pos`` (modulo its length), and the stream
    it decodes to, checked well formed (indices strictly increasing, in range); None
    when the decoder refuses it with a WireFormatError."""
    from sparcml.errors import WireFormatError
    from sparcml.wire import decode

    buf = buf.clone()
    pos = pos % buf.numel()
    for i, byte in enumerate(junk):
        if pos + i < buf.numel():
            buf[pos + i] = byte
    try:
        s = decode(buf)
    except WireFormatError:
        return buf, None
    if not s.is_dense and s.nnz:
        idx = s.indices.long()
        assert bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < s.size
    return buf, s
