"""Imported once by :func:`sparcml.comm.launch.run_processes`' fork server: its ranks
start with sparcml's training layer imported and every compiled CPU kernel loaded.

The fork server imports its ``PRELOAD`` modules once and forks every rank from
itself. Importing this module runs :func:`~sparcml.compress.warmup.warm_kernels`,
which a training state calls when it is built (about 0.4 s of CPU per process,
more with ranks sharing cores): done here, no rank pays it. It lives outside
:mod:`sparcml.compress`, whose package imports all of its modules. Nothing else
should import it; call :func:`~sparcml.compress.warmup.warm_kernels` instead.
"""

from __future__ import annotations

import logging

from ..compress.warmup import warm_kernels

__all__: list[str] = []

try:
    warm_kernels()
except Exception as e:  # the server would die of it, and every launch with it
    logging.getLogger("sparcml").warning(
        "the fork server could not load the compiled kernels (%s); each rank loads them", e
    )
