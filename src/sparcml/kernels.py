"""The library's compiled CPU kernels, loaded on first use.

:mod:`sparcml.cpu_kernels` holds every compiled loop (numba, a declared
dependency): the merges of :mod:`sparcml.merge`, the index widening and narrowing
of :mod:`sparcml.wire`, the threshold scans of :mod:`sparcml.compress.selection`,
the non-zero and finiteness scans of :mod:`sparcml.nonzero` and
:mod:`sparcml.finite`, and natural compression's 9-bit codes
(:mod:`sparcml.compress.natural`). Each
sits behind a torch-facing function in the module that uses it, with torch ops on
other devices (one implementation per device). Loading numba takes a moment, so
the kernels are imported when first needed; :func:`sparcml.compress.warmup.warm_kernels`
loads and runs them all up front.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["compiled"]


def compiled() -> ModuleType:
    """:mod:`sparcml.cpu_kernels`, imported on first use (numba compiles the kernels
    once per machine and caches them on disk)."""
    from . import cpu_kernels  # (relative: a copy of the library under another
    # name, as benchmarks/codec_ab.py loads one, runs its own kernels)

    return cpu_kernels
