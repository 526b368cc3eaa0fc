"""Sparse streams: SparCML's vector representation (paper 000, sec. 5.1).

A :class:`SparseStream` is a vector of dimension ``N`` held either as
(index, value) pairs sorted by index, or densely. Following sec. 5.1 it switches
to the dense representation once the number of stored pairs exceeds

    delta = N * isize / (c + isize),

where ``isize`` is the byte size of a value and ``c`` the byte size of an index
(sec. 5.1's ``c >= ceil(log2(N) / 8)``: the fewest whole bytes that hold every
index below ``N``): past ``delta`` the sparse form would take more bytes than
the dense one.

In memory, indices are ``int64`` tensors (what PyTorch indexes with); the
compact ``c``-byte indices are used on the wire (:mod:`sparcml.wire`).

Input convention: indices given to the constructor may be unsorted and may
repeat; they are sorted and duplicates are *combined by summation* (in the order
they were given, so the result is deterministic). Explicit zero values are kept.

Explicitly stored zeros: a pair whose value is zero stays a pair through every
sum (the union of indices is what a sum stores, whatever the values), and a
value present in one operand only is carried bit for bit (``-0.0`` included:
sparse sums accumulate from ``-0.0``, the identity of IEEE addition; see
:mod:`sparcml.merge`). A sum that turns dense (past ``delta``) adds into ``+0.0``
where an operand has no entry, as a dense allreduce does, so there a ``-0.0`` held
by the other operand alone comes out ``+0.0``: the sign of such a zero can depend on
the algorithm (every rank still gets the same bits). Sparse sums add operands in
the order given.
NaN and Inf values are carried through like any other value, exactly as a dense
allreduce would carry them.

Everything here is pure tensor code: no communication, CPU or CUDA tensors.
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
from collections.abc import Sequence

import torch

from .merge import merge_sum
from .nonzero import count_nonzero, nonzero_positions
from .reinterpret import dense_1d

__all__ = [
    "SUPPORTED_DTYPES",
    "SparseStream",
    "dense_threshold",
    "dense_threshold_of",
    "index_bytes",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)

if sys.byteorder != "little":  # pragma: no cover - all supported platforms are little-endian
    raise ImportError("sparcml's wire format assumes a little-endian host")


def index_bytes(size: int) -> int:
    """Bytes ``c`` of one index on the wire: sec. 5.1's ``ceil(log2(N) / 8)``, at least 1.

    The fewest whole bytes that hold every index in ``[0, size)``: 3 for
    ``N = 2^24`` or a range of 2M entries, where a 2/4/8 choice would send 4 (one
    byte in eight of every float32 pair).

    Args:
        size: the vector dimension ``N``.

    Returns:
        1 to 8.

    Example:
        >>> index_bytes(60_000), index_bytes(16_777_216), index_bytes(16_777_217)
        (2, 3, 4)
    """
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    return max(1, ((size - 1).bit_length() + 7) // 8)  # size 0 or 1: one byte


def dense_threshold(size: int, dtype: torch.dtype) -> int:
    """SparCML's ``delta = N * isize / (c + isize)`` (sec. 5.1), rounded down.

    A stream holding more than ``delta`` pairs is stored densely.

    Example:
        >>> dense_threshold(1_000_000, torch.float32)  # c = 3
        571428
    """
    return dense_threshold_of(size, dtype.itemsize)


def dense_threshold_of(size: int, value_bytes: int) -> int:
    """:func:`dense_threshold` for values of ``value_bytes`` bytes each."""
    return (size * value_bytes) // (index_bytes(size) + value_bytes)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported value dtype {dtype}; sparse streams hold {names}")


#: The largest stream size: sizes travel, and indices are held, as int64.
MAX_SIZE = (1 << 63) - 1


def _check_size(size: object) -> int:
    """``size`` as an int: integers (Python, NumPy, 0-d integer tensors) only; a float
    such as 4.5 is refused, never truncated."""
    try:
        n = operator.index(size)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"size must be an integer, got {size!r} ({type(size).__name__})") from None
    if n < 0:
        raise ValueError(f"size must be non-negative, got {n}")
    if n > MAX_SIZE:
        raise ValueError(f"size must be at most 2^63 - 1 (sizes and indices are int64), got {n}")
    return n


def _check_values(values: torch.Tensor) -> None:
    _check_dtype(values.dtype)
    if values.requires_grad:
        raise ValueError(
            "values require grad: sparse collectives are not differentiable (their "
            "result carries no autograd history); pass tensor.detach()"
        )


def _coalesce(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort by index and sum duplicates, in the order given (deterministic)."""
    order = torch.argsort(indices, stable=True)
    indices = indices[order]
    values = values[order]
    if indices.numel() < 2:
        return indices, values
    unique, counts = torch.unique_consecutive(indices, return_counts=True)
    if unique.numel() == indices.numel():
        return indices, values
    # segment_reduce adds each segment left to right: the same bits on every run.
    return unique, torch.segment_reduce(values, "sum", lengths=counts)


class SparseStream:
    """A vector of dimension ``N`` stored sparse (sorted index/value pairs) or dense.

    Args:
        indices: 1-D integer tensor of positions in ``[0, size)``; may be unsorted
            and may repeat (duplicates are summed).
        values: 1-D float tensor (float32, float16, bfloat16 or float64), same
            length and device as ``indices``.
        size: the dimension ``N``.

    Raises:
        TypeError: integer/float dtype problems, tensors on different devices, or a
            size that is not an integer (4.5 is refused, not truncated).
        ValueError: shape mismatch, negative size, an index outside ``[0, size)``, or
            values that require grad (collectives are not differentiable: pass
            ``tensor.detach()``).

    Example:
        >>> s = SparseStream(torch.tensor([7, 2]), torch.tensor([1.0, 3.0]), size=10)
        >>> s.indices.tolist(), s.values.tolist(), s.is_dense
        ([2, 7], [3.0, 1.0], False)
        >>> (s + s).to_dense()[2].item()
        6.0
    """

    __slots__ = ("_dense", "_indices", "_size", "_values")

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, size: int) -> None:
        size = _check_size(size)
        if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError("indices and values must be torch tensors")
        if indices.dim() != 1 or values.dim() != 1:
            raise ValueError(
                f"indices and values must be 1-D, got shapes {tuple(indices.shape)} "
                f"and {tuple(values.shape)}"
            )
        if indices.numel() != values.numel():
            raise ValueError(
                f"indices and values differ in length: {indices.numel()} vs {values.numel()}"
            )
        if (
            indices.dtype.is_floating_point
            or indices.dtype.is_complex
            or indices.dtype == torch.bool
        ):
            raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
        _check_values(values)
        if indices.device != values.device:
            raise TypeError(
                f"indices on {indices.device} but values on {values.device}; "
                "put both on the same device"
            )
        indices = indices.to(torch.int64)
        if indices.numel():
            lo, hi = torch.aminmax(indices)
            lo_i, hi_i = int(lo), int(hi)
            if lo_i < 0 or hi_i >= size:
                bad = lo_i if lo_i < 0 else hi_i
                raise ValueError(f"index {bad} out of range for a stream of size {size}")
            if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
                indices, values = _coalesce(indices, values)
        self._set_sparse(dense_1d(indices), dense_1d(values), size)
        self._maybe_densify()

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_sorted(cls, indices: torch.Tensor, values: torch.Tensor, size: int) -> SparseStream:
        """Build from pairs the caller guarantees: 1-D, sorted, unique, in ``[0, size)``,
        of a supported dtype, on one device (nothing is checked: no device sync;
        integer indices of another width are widened to int64, as every stream holds
        them).

        The fast path of the collectives, selectors and decoders, which produce
        such pairs by construction; anything else should use the constructor.
        Turns dense past ``delta`` like the constructor does.

        Example:
            >>> SparseStream.from_sorted(torch.tensor([1, 4]), torch.tensor([2.0, 3.0]), 8).nnz
            2
        """
        if indices.dtype != torch.int64:  # (as the constructor holds them; a no-op check)
            indices = indices.to(torch.int64)
        s = cls.__new__(cls)
        s._set_sparse(indices, values, size)
        s._maybe_densify()
        return s

    @classmethod
    def dense(cls, tensor: torch.Tensor) -> SparseStream:
        """Wrap a 1-D tensor as a dense stream (no copy; the stream owns ``tensor``)."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"a dense stream is built from a 1-D tensor, got {shape}")
        _check_values(tensor)
        s = cls.__new__(cls)
        s._size = tensor.numel()
        s._dense = True
        s._indices = None
        s._values = dense_1d(tensor)
        return s

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> SparseStream:
        """The non-zero entries of a 1-D tensor (NaN counts as non-zero).

        The stream is sparse if the non-zeros number at most ``delta``, dense otherwise.

        Example:
            >>> SparseStream.from_dense(torch.tensor([0.0, 2.0, 0.0])).indices.tolist()
            [1]
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"from_dense expects a tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise ValueError(
                f"from_dense expects a 1-D tensor, got shape {tuple(tensor.shape)}; "
                "flatten it first"
            )
        _check_values(tensor)
        out = cls._sparsified(tensor)
        return cls.dense(tensor.clone()) if out.is_dense else out

    @classmethod
    def _sparsified(cls, tensor: torch.Tensor) -> SparseStream:
        """``from_dense`` without its checks and with a dense result that shares
        ``tensor``'s storage (no copy)."""
        size = tensor.numel()
        # count first (one read pass): a dense tensor never materialises its N int64
        # positions (writing them all costs far more than reading)
        count = count_nonzero(tensor)
        if count > dense_threshold(size, tensor.dtype):
            return cls.dense(tensor)
        idx = nonzero_positions(tensor, count)
        return cls.from_sorted(idx, tensor.index_select(0, idx), size)

    @classmethod
    def from_torch_sparse(cls, tensor: torch.Tensor) -> SparseStream:
        """A PyTorch sparse COO tensor (any shape, hybrid included) as a stream over
        its flattened (row-major) entries, without densifying.

        The gradient of ``nn.Embedding(..., sparse=True)`` is such a tensor: one
        sparse dimension (the rows) and one dense (the embedding); each stored row
        becomes ``dim`` consecutive pairs. Duplicates are summed (``coalesce``);
        stored zeros are kept, as the constructor keeps explicit zeros.

        Raises:
            TypeError: not a sparse COO tensor, or an unsupported dtype.

        Example:
            >>> g = torch.sparse_coo_tensor([[2, 0]], torch.ones(2, 3), (4, 3))
            >>> SparseStream.from_torch_sparse(g).indices.tolist()
            [0, 1, 2, 6, 7, 8]
        """
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            what = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"from_torch_sparse expects a sparse COO tensor, got {what}")
        _check_dtype(tensor.dtype)
        t = tensor.detach().coalesce()
        sd = t.sparse_dim()
        shape = tuple(t.shape)
        inner = math.prod(shape[sd:])
        size = math.prod(shape)
        coords = t.indices()  # (sparse_dim, nnz), lexicographically sorted by coalesce
        device = coords.device
        if sd == 1:  # (an embedding's rows, a vector: the coordinates are the offsets)
            linear = coords[0]
        else:
            strides = torch.tensor(
                [math.prod(shape[i + 1 : sd]) for i in range(sd)], dtype=torch.int64, device=device
            )
            # (no sparse dimension: at most one entry, the whole tensor, at offset 0)
            linear = (coords * strides[:, None]).sum(0) if sd else coords.new_zeros(coords.shape[1])
        values = t.values().reshape(coords.shape[1], inner)  # (0 wide: no -1 to infer)
        if inner == 1:
            flat = linear
        else:
            flat = (linear[:, None] * inner + torch.arange(inner, device=device)).reshape(-1)
        return cls.from_sorted(flat, dense_1d(values.reshape(-1)), size)

    def to_torch_sparse(
        self, shape: Sequence[int] | None = None, sparse_dim: int | None = None
    ) -> torch.Tensor:
        """This stream as a coalesced PyTorch sparse COO tensor of ``shape`` (default ``(N,)``).

        ``sparse_dim`` (default: all dimensions) leaves the trailing dimensions dense:
        ``sparse_dim=1`` gives the row layout of an embedding gradient (a stored row
        for every row with any stored entry, zeros filled in).

        Raises:
            ValueError: ``shape`` does not hold ``N`` entries, or a bad ``sparse_dim``.

        Example:
            >>> s = SparseStream(torch.tensor([1, 7]), torch.tensor([1.0, 2.0]), 12)
            >>> s.to_torch_sparse((4, 3), sparse_dim=1).to_dense().tolist()
            [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
        """
        shape = tuple(shape) if shape is not None else (self._size,)
        if math.prod(shape) != self._size:
            raise ValueError(f"shape {shape} does not hold the stream's {self._size} entries")
        sd = len(shape) if sparse_dim is None else sparse_dim
        if not 0 < sd <= len(shape):
            raise ValueError(f"sparse_dim must lie in [1, {len(shape)}], got {sparse_dim}")
        inner = math.prod(shape[sd:])
        idx, vals = self.indices, self.values
        if inner > 1:
            rows, inverse = torch.unique_consecutive(idx // inner, return_inverse=True)
            dense_rows = torch.zeros(rows.numel(), inner, dtype=self.dtype, device=self.device)
            dense_rows[inverse, idx % inner] = vals
            idx, vals = rows, dense_rows.reshape(rows.numel(), *shape[sd:])
        elif sd < len(shape):  # trailing dimensions of size 1 (an embedding of width 1)
            vals = vals.reshape(vals.numel(), *shape[sd:])
        # row-major coordinates; the first needs no remainder (idx < its extent times
        # the rest), so a single sparse dimension is idx itself: no division
        coords = []
        rest = idx
        for d in reversed(shape[1:sd]):
            coords.append(rest % d)
            rest = rest // d
        coords.append(rest)
        index = torch.stack(coords[::-1])
        return torch.sparse_coo_tensor(
            index,
            vals,
            shape,
            dtype=self.dtype,
            device=self.device,
            is_coalesced=True,
            check_invariants=False,  # valid by construction (sorted, unique, in range)
        )

    @classmethod
    def empty(
        cls, size: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> SparseStream:
        """A stream with no non-zero entries."""
        _check_dtype(dtype)
        size = _check_size(size)
        return cls.from_sorted(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=dtype, device=device),
            size,
        )

    def _set_sparse(self, indices: torch.Tensor, values: torch.Tensor, size: int) -> None:
        self._size = size
        self._dense = False
        self._indices = indices
        self._values = values

    def _maybe_densify(self) -> None:
        if not self._dense and self._values.numel() > dense_threshold(self._size, self.dtype):
            self._values = self.to_dense()
            self._indices = None
            self._dense = True

    # ------------------------------------------------------------------ properties
    @property
    def size(self) -> int:
        """The dimension ``N``."""
        return self._size

    @property
    def is_dense(self) -> bool:
        return self._dense

    @property
    def nnz(self) -> int:
        """Entries held: the number of pairs if sparse, ``N`` if dense."""
        return self._values.numel()

    @property
    def indices(self) -> torch.Tensor:
        """Sorted int64 positions (``arange(N)`` for a dense stream)."""
        if self._dense:
            return torch.arange(self._size, device=self._values.device)
        return self._indices

    @property
    def values(self) -> torch.Tensor:
        """Values at :attr:`indices` (the whole vector for a dense stream)."""
        return self._values

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def device(self) -> torch.device:
        return self._values.device

    @property
    def delta(self) -> int:
        """The dense-switch threshold of this stream's size and dtype."""
        return dense_threshold(self._size, self.dtype)

    def count_nonzero(self) -> int:
        """Number of non-zero entries of the vector (NaN counts as non-zero; read from
        the values' bits, :func:`sparcml.nonzero.count_nonzero`)."""
        return count_nonzero(self._values)

    def __repr__(self) -> str:
        kind = "dense" if self._dense else f"sparse, nnz={self.nnz}"
        return f"SparseStream(size={self._size}, {kind}, dtype={self.dtype}, device={self.device})"

    # ------------------------------------------------------------------ conversions
    def to_dense(self) -> torch.Tensor:
        """The vector as a dense 1-D tensor (a new tensor for sparse, the storage for dense)."""
        if self._dense:
            return self._values
        out = torch.zeros(self._size, dtype=self.dtype, device=self.device)
        # (the indices are distinct: index_copy_ writes what out[indices] = values
        # writes, and runs faster on the CPU than advanced indexing's index_put_)
        return out.index_copy_(0, self._indices, self._values)

    def to(self, device: torch.device | str) -> SparseStream:
        """This stream on another device."""
        device = torch.device(device)
        if device == self.device:
            return self
        if self._dense:
            return SparseStream.dense(self._values.to(device))
        return SparseStream.from_sorted(
            self._indices.to(device), self._values.to(device), self._size
        )

    def clone(self) -> SparseStream:
        if self._dense:
            return SparseStream.dense(self._values.clone())
        return SparseStream.from_sorted(self._indices.clone(), self._values.clone(), self._size)

    # ------------------------------------------------------------------ summation
    def _check_compatible(self, other: SparseStream) -> None:
        if not isinstance(other, SparseStream):
            raise TypeError(f"cannot add SparseStream and {type(other).__name__}")
        if other._size != self._size:
            raise ValueError(f"cannot add streams of sizes {self._size} and {other._size}")
        if other.dtype != self.dtype:
            raise TypeError(f"cannot add streams of dtypes {self.dtype} and {other.dtype}")
        if other.device != self.device:
            raise TypeError(f"cannot add streams on {self.device} and {other.device}")

    def __add__(self, other: SparseStream) -> SparseStream:
        """Sum of two streams of the same size (sec. 5.1, "Efficient Summation").

        * sparse + sparse, indices may overlap: if ``|H1| + |H2| > delta`` (the
          paper's cheap upper bound of the union) the result is dense, else the
          sorted union with values summed;
        * sparse + dense: the pairs are added into a copy of the dense vector;
        * dense + dense: a vectorised dense sum.

        Deterministic: the same operands in the same order give the same bits on
        every device and run (collectives always add in rank order).
        """
        self._check_compatible(other)
        if self._dense and other._dense:
            return SparseStream.dense(self._values + other._values)
        if self._dense or other._dense:
            dense, sparse = (self, other) if self._dense else (other, self)
            out = dense._values.clone()
            out[sparse._indices] += sparse._values
            return SparseStream.dense(out)
        if self.nnz + other.nnz > self.delta:
            out = self.to_dense()
            out[other._indices] += other._values
            return SparseStream.dense(out)
        union, values = merge_sum([self._indices, other._indices], [self._values, other._values])
        return SparseStream.from_sorted(union, values, self._size)

    def add_(self, other: SparseStream) -> SparseStream:
        """In-place sum; reuses this stream's storage when it is dense (dense+dense in place)."""
        self._check_compatible(other)
        if self._dense:
            if other._dense:
                self._values += other._values
            else:
                self._values[other._indices] += other._values
            return self
        result = self + other
        self._dense, self._indices, self._values = result._dense, result._indices, result._values
        return self

    @staticmethod
    def sum(streams: Sequence[SparseStream]) -> SparseStream:
        """Sum of several streams, each entry added in list order (deterministic).

        All-sparse inputs are merged in one pass (:func:`sparcml.merge.merge_sum`:
        a linear merge of the sorted runs, values added in list order), which is much
        cheaper than pairwise unions for many pieces; the result is dense if the exact
        union exceeds ``delta``. With a dense input the streams are added pairwise,
        left to right.

        Raises:
            ValueError: if ``streams`` is empty.
        """
        if not streams:
            raise ValueError("SparseStream.sum needs at least one stream")
        first = streams[0]
        for s in streams[1:]:
            first._check_compatible(s)
        if len(streams) > 2 and not any(s._dense for s in streams):
            indices, values = merge_sum([s._indices for s in streams], [s._values for s in streams])
            return SparseStream.from_sorted(indices, values, first._size)
        acc = first
        for s in streams[1:]:
            acc = acc + s
        return acc

    # ------------------------------------------------------------------ partitions
    def split(self, boundaries: Sequence[int], *, sparsify: bool = True) -> list[SparseStream]:
        """Split into the index ranges ``[b[j], b[j+1])``; indices become local to each range.

        The parts share this stream's storage (views, like a sparse stream's
        slices): use them as read-only.

        Args:
            boundaries: non-decreasing positions starting at 0 and ending at ``N``.
            sparsify: a dense stream's parts become sparse where their non-zeros
                number at most ``delta`` (as :meth:`from_dense`); with False they stay
                dense (a caller that chooses the form itself, such as the quantized
                encoder, which counts by the quantized sizes).

        Returns:
            ``len(boundaries) - 1`` streams; part ``j`` has size ``b[j+1] - b[j]``.

        Example:
            >>> s = SparseStream(torch.tensor([1, 5, 8]), torch.ones(3), 10)
            >>> [p.indices.tolist() for p in s.split([0, 5, 10])]
            [[1], [0, 3]]
        """
        b = [int(x) for x in boundaries]
        if len(b) < 2 or b[0] != 0 or b[-1] != self._size:
            raise ValueError(
                f"boundaries must start at 0 and end at the size {self._size}, got {b}"
            )
        if any(b[i] > b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"boundaries must be non-decreasing, got {b}")
        if self._dense:
            views = [self._values[lo:hi] for lo, hi in itertools.pairwise(b)]
            if not sparsify:
                return [SparseStream.dense(v) for v in views]
            return [SparseStream._sparsified(v) for v in views]
        cuts = torch.searchsorted(
            self._indices, torch.tensor(b, dtype=torch.int64, device=self.device)
        ).tolist()
        return [
            SparseStream.from_sorted(
                self._indices[cuts[j] : cuts[j + 1]] - b[j],
                self._values[cuts[j] : cuts[j + 1]],
                b[j + 1] - b[j],
            )
            for j in range(len(b) - 1)
        ]

    @staticmethod
    def concat(parts: Sequence[SparseStream]) -> SparseStream:
        """Disjoint summation by concatenation (sec. 5.1): the inverse of :meth:`split`.

        Part ``j`` covers the index range right after part ``j-1``; the result has
        size ``sum(part sizes)`` and is dense if its pairs exceed ``delta``.
        """
        if not parts:
            raise ValueError("SparseStream.concat needs at least one part")
        dtype, device = parts[0].dtype, parts[0].device
        for p in parts:
            if p.dtype != dtype or p.device != device:
                raise TypeError("cannot concatenate streams of different dtypes or devices")
        size = sum(p.size for p in parts)
        total = sum(p.nnz for p in parts)
        if any(p.is_dense for p in parts) or total > dense_threshold(size, dtype):
            return SparseStream.dense(torch.cat([p.to_dense() for p in parts]))
        # one pass per part: shifted indices written straight into the result
        indices = torch.empty(total, dtype=torch.int64, device=device)
        offset = start = 0
        for p in parts:
            torch.add(p._indices, offset, out=indices[start : start + p.nnz])
            offset += p.size
            start += p.nnz
        values = torch.cat([p._values for p in parts])
        return SparseStream.from_sorted(indices, values, size)

    def equal(self, other: SparseStream) -> bool:
        """Bitwise equality of representation and content (NaNs compare by bits)."""
        if (
            self._size != other._size
            or self._dense != other._dense
            or self.dtype != other.dtype
            or self.nnz != other.nnz
        ):
            return False
        if not self._dense and not torch.equal(self._indices, other._indices.to(self.device)):
            return False
        a = self._values.view(_bits_dtype(self.dtype))
        b = other._values.to(self.device).view(_bits_dtype(self.dtype))
        return bool(torch.equal(a, b))


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
