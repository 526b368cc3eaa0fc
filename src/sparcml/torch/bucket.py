"""One bucket of one step: what every entry point hands the pipeline."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Bucket"]


@dataclasses.dataclass
class Bucket:
    """One bucket of one step: parameter names and sizes, and this rank's gradient."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    grad: torch.Tensor  # flat
    step: int
    op_key: tuple[str, ...] | None = None  # where its operators are kept, if not names
    #: bytes per entry of a dense reduction of the bucket (statistics): the gradient's
    #: own, where an adapter cast it (FSDP2 compresses 16-bit gradients in float32)
    itemsize: int | None = None

    @property
    def key(self) -> tuple[str, ...]:
        """The key of the bucket's operators and per-bucket method state."""
        return self.names if self.op_key is None else self.op_key
