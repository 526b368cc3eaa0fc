"""Every compiled CPU kernel loaded and run once, before training starts.

A process's first call of a compiled kernel loads it from numba's disk cache (and
compiles it, the first time on a machine). Inside a collective that would stall
every other rank at whatever step the kernel is first needed, so training states
(:class:`sparcml.torch.SparcmlState`) call :func:`warm_kernels` when they are built.
"""

from __future__ import annotations

import torch

from ..finite import all_finite
from ..indexcode import elias_fano_nbytes, read_elias_fano, write_elias_fano
from ..merge import merge_positions, merge_sum
from ..nonzero import drop_zeros, nonzero_positions
from ..reinterpret import index_low_bytes
from ..wire import widen_increasing, write_index_field
from .natural import natural9_decode, natural9_encode
from .selection import above_positions, bracket_band, top_k_of_candidates

__all__ = ["warm_kernels"]


def warm_kernels() -> None:
    """Load the compiled CPU kernels now and run each once on a few entries.

    A process's first call of a compiled kernel loads it from numba's disk cache
    (compiles it, the first time on a machine) and starts numba's runtime, which can
    take longer than a whole training step, more with compilation (docs/training.md).
    Inside a collective that stalls every other rank for as long, at whatever step the
    kernel is first needed; training states (:class:`sparcml.torch.SparcmlState`) call
    this when they are built instead.
    """
    runs = [torch.tensor([1, 5]), torch.tensor([2, 5]), torch.tensor([3])]
    merge_positions(runs[:2])  # two runs
    merge_positions(runs)  # a bitmap of their span
    merge_positions([torch.tensor([1, 1000]), *runs[1:]])  # a k-way merge
    for dtype in (torch.float32, torch.float64):  # two runs merged and summed in one pass
        merge_sum(runs[:2], [torch.ones(2, dtype=dtype), torch.ones(2, dtype=dtype)])
    out = torch.empty(2, dtype=torch.int64)
    for c in (1, 2, 3, 4, 8):  # 3: the compiled pass of every width that is not a word
        widen_increasing(index_low_bytes(torch.tensor([1, 2]), c), c, 4, out)
    write_index_field(torch.empty(6, dtype=torch.uint8), torch.tensor([1, 2]), 3)
    field = torch.empty(elias_fano_nbytes(4096, 2, 9), dtype=torch.uint8)  # a low byte, a plane
    write_elias_fano(field, torch.tensor([1, 2000]), 4096, 9)
    read_elias_fano(field, 4096, 9, out)
    for dtype in (torch.int16, torch.int32, torch.int64):
        above_positions(torch.tensor([1, 3], dtype=dtype), -1, 2, 0, out)
    for dtype in (torch.float32, torch.float64):
        mags = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
        bracket_band(mags, 0.75, 1.5, torch.empty_like(mags))
        top_k_of_candidates(mags, torch.tensor([0, 2]), 1, out)
    codes = torch.empty(4, dtype=torch.uint8)
    for deterministic in (False, True):
        bits = torch.tensor([1.5, -3.0], dtype=torch.float32).view(torch.int32)
        natural9_encode(bits, bits, deterministic, codes[:2], codes[2:3])
    natural9_decode(codes[:2], codes[2:3], torch.empty(2, dtype=torch.int32))
    pair = torch.tensor([1, 2])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        values = torch.tensor([1.0, 0.0], dtype=dtype)
        all_finite(values)  # every kernel of sparcml.nonzero and all_finite's, each word width
        nonzero_positions(values)
        drop_zeros(pair, values)
