"""Error feedback: keep what compression did not send and add it to the next gradient.

SparCML's Alg. 1 (paper 000): ``acc_t = eps_(t-1) + lr * grad_t``, send
``TopK(acc_t)``, keep ``eps_t = acc_t - TopK(acc_t)``. RedSync's residual
gradient compression (paper 002, Alg. 1) and Ok-Topk SGD keep residuals the same
way. :class:`ErrorFeedback` holds one residual tensor per name (a parameter, a
DDP bucket), reused in place: memory does not grow over steps.

Invariant (tested in float64): ``acc == sent + residual`` after :meth:`update`.

The same object serves the per-tensor SGD steps (:func:`~sparcml.torch.topk_sgd_step`)
and the training pipeline (the DDP hook, ``sync_gradients``, FSDP), which works on
*buckets*: a flat view of several parameters. :meth:`NamedBuffers.gather` builds a
bucket's flat view from the per-name buffers (zeros where none exists yet) and
:meth:`NamedBuffers.scatter` stores a flat result back by name, so buffers survive
DDP's bucket rebuilds. :class:`MomentumCorrection` is the sibling that keeps DGC's
momentum ``u`` per name (RedSync sec. 3.5: ``u = m u + g; v = v + u``, momentum
factor masking). Both have ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..stream import SparseStream

__all__ = ["ErrorFeedback", "MomentumCorrection", "NamedBuffers"]


class NamedBuffers:
    """One tensor per name, with bucket views: the storage both feedbacks share."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        # the flat tensor of each bucket's last scatter, with the views it stored: a
        # bucket whose buffers are still those views is read without a copy
        self._flats: dict[tuple[str, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors by name (the live mapping)."""
        return self._residuals

    @buffers.setter
    def buffers(self, value: dict[str, torch.Tensor]) -> None:
        self._residuals = dict(value)
        self._flats.clear()

    def gather(
        self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor:
        """A bucket's flat view: the buffers of ``names`` concatenated (moved to
        ``like``'s device and dtype), zeros where a buffer is missing or of another size.

        Read-only: when the buffers are still the views the bucket's last
        :meth:`scatter` stored (every step of a training run after the first), this
        is that flat tensor itself, not a copy (one pass over the bucket less).
        """
        hit = self._flats.get(tuple(names))
        if hit is not None:
            flat, views = hit
            if (
                flat.dtype == like.dtype
                and flat.device == like.device
                and all(v.numel() == n for v, n in zip(views, sizes, strict=True))
                and all(self._residuals.get(k) is v for k, v in zip(names, views, strict=True))
            ):
                return flat
        parts = []
        for name, n in zip(names, sizes, strict=True):
            t = self._residuals.get(name)
            if t is None or t.numel() != n:
                t = torch.zeros(n, dtype=like.dtype, device=like.device)
            elif t.dtype != like.dtype or t.device != like.device:
                # (a checkpoint loaded with map_location="cpu", another residual
                # precision: the same values where they are needed, not zeros)
                t = t.to(device=like.device, dtype=like.dtype)
            parts.append(t.reshape(-1))
        return torch.cat(parts) if parts else like.new_zeros(0)

    def scatter(self, names: Sequence[str], sizes: Sequence[int], flat: torch.Tensor) -> None:
        """Store a bucket's flat tensor back by name (views of ``flat``, no copy)."""
        views = list(flat.split(list(sizes)))
        for name, part in zip(names, views, strict=True):
            self._residuals[name] = part
        key = tuple(names)
        mine = set(key)
        for other in [k for k in self._flats if k != key and mine.intersection(k)]:
            del self._flats[other]  # (a rebuilt bucket: its old flat tensor is stale)
        self._flats[key] = (flat, views)

    def reset(self, name: str | None = None) -> None:
        """Forget one buffer, or all."""
        self._flats.clear()
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self._flats.clear()

    def __len__(self) -> int:
        return len(self._residuals)


class MomentumCorrection(NamedBuffers):
    """DGC momentum correction (RedSync sec. 3.5): the momentum ``u`` per name.

    ``accumulate`` gives ``u = m u + g`` for a bucket (what is added to the
    residual instead of ``g``); ``keep`` stores it back, zeroed where the rank sent
    (momentum factor masking) when ``masking``.

    Args:
        momentum: ``m`` in ``[0, 1)``.
        masking: DGC's momentum factor masking.
    """

    def __init__(self, momentum: float, masking: bool = True) -> None:
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum, self.masking = float(momentum), masking

    def accumulate(
        self, names: Sequence[str], sizes: Sequence[int], g: torch.Tensor
    ) -> torch.Tensor:
        """``u = m u + g`` for the bucket (a new tensor; not stored yet: see :meth:`keep`)."""
        u = self.gather(names, sizes, g) * self.momentum
        return u.add_(g)

    def keep(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        u: torch.Tensor,
        sent: torch.Tensor | SparseStream | None = None,
    ) -> None:
        """Store ``u`` (the tensor itself: the caller gives it up), zeroed where this
        rank sent ``sent`` when masking (momentum factor masking, DGC sec. 3.2; a
        dense ``sent`` tensor masks everything, a dense stream its non-zeros)."""
        if sent is not None and self.masking:
            if isinstance(sent, SparseStream) and not sent.is_dense:
                u[sent.indices] = 0.0
            elif isinstance(sent, SparseStream):
                u = u.masked_fill(sent.to_dense() != 0, 0.0)
            else:
                u = torch.zeros_like(u)
        self.scatter(names, sizes, u)


class ErrorFeedback(NamedBuffers):
    """Residuals per tensor name.

    Example:
        >>> ef = ErrorFeedback()
        >>> acc = ef.compensate(torch.tensor([3.0, 0.1]), "w")
        >>> ef.update(acc, torch.tensor([3.0, 0.0]), "w")
        >>> ef.residual("w").tolist()
        [0.0, 0.10000000149011612]
    """

    def residual(self, name: str) -> torch.Tensor | None:
        """The current residual of ``name`` (None before the first update)."""
        return self._residuals.get(name)

    def compensate(self, grad: torch.Tensor, name: str, lr: float | None = None) -> torch.Tensor:
        """``acc = residual + grad`` (or ``residual + lr * grad``); a new tensor.

        Raises:
            ValueError: ``grad``'s shape, dtype or device differ from the stored residual.
        """
        # Row-major whatever the gradient's layout (channels_last, transposed views):
        # residuals and sent streams index the flattened tensor.
        g = grad.detach()
        acc = torch.mul(g, lr) if lr is not None else g.clone()
        if not acc.is_contiguous():
            acc = acc.contiguous()
        r = self._residuals.get(name)
        if r is not None:
            if r.shape != acc.shape or r.dtype != acc.dtype or r.device != acc.device:
                raise ValueError(
                    f"error feedback {name!r}: gradient {tuple(acc.shape)} {acc.dtype} on "
                    f"{acc.device} does not match the residual {tuple(r.shape)} {r.dtype} on "
                    f"{r.device} (did the parameter change? call reset({name!r}))"
                )
            acc += r
        return acc

    def update(self, acc: torch.Tensor, sent: torch.Tensor | SparseStream, name: str) -> None:
        """Keep ``acc - sent`` as the residual of ``name`` (in place when possible).

        Args:
            acc: what was compressed (from :meth:`compensate`).
            sent: what the compression sent, dense (``decompress`` output) or as a
                sparse stream over ``acc.flatten()``.
        """
        # Validate first: a rejected call must leave the residual untouched.
        if isinstance(sent, SparseStream):
            if sent.size != acc.numel():
                raise ValueError(
                    f"error feedback {name!r}: sent stream of size {sent.size}, tensor "
                    f"has {acc.numel()} entries"
                )
        elif sent.shape != acc.shape:
            raise ValueError(
                f"error feedback {name!r}: sent {tuple(sent.shape)} vs {tuple(acc.shape)}"
            )
        r = self._residuals.get(name)
        if r is None or r.shape != acc.shape or r.dtype != acc.dtype or r.device != acc.device:
            r = torch.empty(acc.shape, dtype=acc.dtype, device=acc.device)
            self._residuals[name] = r
        r.copy_(acc)
        if isinstance(sent, SparseStream):
            flat = r.view(-1)
            if sent.is_dense:
                flat -= sent.values.to(acc.dtype)
            else:
                flat[sent.indices] -= sent.values.to(acc.dtype)
        else:
            r -= sent.to(acc.dtype)

    def compensate_bucket(
        self, names: Sequence[str], sizes: Sequence[int], g: torch.Tensor
    ) -> torch.Tensor:
        """A bucket's ``acc = residual + g`` (``g`` flat; a new tensor)."""
        return self.gather(names, sizes, g) + g

    def update_bucket(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        acc: torch.Tensor,
        sent: torch.Tensor | SparseStream,
    ) -> None:
        """A bucket's ``residual = acc - sent``, stored by name.

        ``sent`` dense (a flat tensor or a dense stream): a new tensor. A sparse
        stream: ``acc`` itself becomes the residual, the sent entries subtracted in
        place (O(k) instead of two passes over the bucket); the caller gives ``acc``
        up. Either way the same arithmetic: unsent entries keep ``acc``'s value.
        """
        if isinstance(sent, SparseStream) and not sent.is_dense:
            acc[sent.indices] -= sent.values.to(acc.dtype)
            self.scatter(names, sizes, acc)
            return
        dense = sent.to_dense() if isinstance(sent, SparseStream) else sent
        self.scatter(names, sizes, acc - dense.to(acc.dtype))
