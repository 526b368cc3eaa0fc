"""Where a vector's values are not zero: a dense vector's non-zero positions, and a
sparse vector's pairs without the ones whose value is zero.

NaN counts as non-zero; ``+0.0`` and ``-0.0`` do not (what ``x != 0`` says). The
test reads the values' bit patterns with the sign bit masked off: a zero is the
one value with no other bit set. One implementation per device:

* CPU (float32, float64, float16, bfloat16): one compiled pass each
  (:mod:`sparcml.cpu_kernels`). torch's ``nonzero`` and boolean-mask indexing cost
  microseconds a call and nanoseconds an entry on the CPU build this library is
  developed on: dropping two zeros from 8,770 pairs is 4.1x-5.0x faster here, from
  65,536 pairs 8.7x-9.0x, and a 2^20 vector's non-zero positions 3.1x-3.3x
  (``benchmarks/nonzero_scan.py``, docs/training.md "Torch's small operations on
  the CPU");
* other devices: torch operations.

Under ``torch.set_flush_denormal(True)`` a subnormal value still counts as
non-zero here, where the CPU's ``x != 0`` would call it zero: the bits decide, so
every rank keeps the same pairs whatever its floating-point mode. (Comparisons the
library still makes in torch, such as momentum factor masking's ``!= 0``, follow the
mode; the difference is a subnormal's worth.)
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels import compiled
from .reinterpret import dense_1d

__all__ = ["MAGNITUDE_BITS", "count_nonzero", "drop_zeros", "nonzero_positions"]

#: the integer view of each float dtype and the mask of its magnitude bits (the sign
#: masked off): zero is the only value without any, and non-negative magnitudes order
#: like the masked patterns, NaN above +inf (the top-k selection's threshold scans
#: compare them so: :mod:`sparcml.compress.selection`)
MAGNITUDE_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}


def _words(x: torch.Tensor) -> tuple[np.ndarray, np.generic] | None:
    """The bit patterns of a CPU float vector as a 1-D array, and its magnitude mask
    as a scalar of the words' own type (numba then compares without widening);
    None where the compiled passes do not apply."""
    if x.device.type != "cpu" or x.dtype not in MAGNITUDE_BITS:
        return None
    idtype, mask = MAGNITUDE_BITS[x.dtype]
    words = dense_1d(x.detach()).view(idtype).numpy()
    return words, words.dtype.type(mask)


def count_nonzero(x: torch.Tensor) -> int:
    """How many entries of ``x`` (any shape) are not zero, NaN included."""
    found = _words(x)
    if found is None:
        return int(torch.count_nonzero(x))
    return int(compiled().count_nonzero_bits(*found))


def nonzero_positions(x: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The sorted int64 positions of the non-zero entries of the 1-D ``x`` (NaN
    included): ``torch.nonzero(x).flatten()``. ``count``: :func:`count_nonzero`
    ``(x)``, where the caller has it already.

    Example:
        >>> nonzero_positions(torch.tensor([0.0, 1.5, -0.0, float("nan")])).tolist()
        [1, 3]
    """
    found = _words(x)
    if found is None:
        return torch.nonzero(x).flatten()
    kernels = compiled()
    if count is None:
        count = int(kernels.count_nonzero_bits(*found))
    out = torch.empty(count, dtype=torch.int64)
    n = int(kernels.nonzero_bits_positions(*found, out.numpy()))
    if n != count:
        raise ValueError(f"{count} non-zeros given for a vector that holds {n}")
    return out


def drop_zeros(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of 1-D ``indices`` (int64) and ``values`` whose value is not zero
    (NaN kept, ``-0.0`` not), in order: the same two tensors, not copied, when none
    is zero (the usual case).

    Example:
        >>> i, v = drop_zeros(torch.tensor([2, 5, 7]), torch.tensor([1.0, -0.0, 2.0]))
        >>> i.tolist(), v.tolist()
        ([2, 7], [1.0, 2.0])
    """
    if indices.numel() != values.numel():
        raise ValueError(f"{indices.numel()} indices for {values.numel()} values")
    found = _words(values) if indices.dtype == torch.int64 else None
    if found is None:
        zero = values == 0
        if not bool(zero.any()):
            return indices, values
        keep = ~zero
        return indices[keep], values[keep]
    words, mask = found
    kernels = compiled()
    if kernels.first_zero_bits(words, mask) < 0:
        return indices, values
    out_indices = torch.empty(words.shape[0], dtype=torch.int64)
    out_words = torch.empty(words.shape[0], dtype=MAGNITUDE_BITS[values.dtype][0])
    n = int(
        kernels.drop_zero_pairs(
            dense_1d(indices).numpy(), words, mask, out_indices.numpy(), out_words.numpy()
        )
    )
    return out_indices[:n], out_words[:n].view(values.dtype)
