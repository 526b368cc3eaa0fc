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
        # buckets whose flat tensor is known to hold zeros only: the tensor's version
        # counter when that was last true (any in-place write since, e.g. a checkpoint
        # loaded into the buffers, bumps it, and the mark no longer holds)
        self._zero: dict[tuple[str, ...], int] = {}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors by name (the live mapping)."""
        return self._residuals

    @buffers.setter
    def buffers(self, value: dict[str, torch.Tensor]) -> None:
        self._residuals = dict(value)
        self._flats.clear()
        self._zero.clear()

    def _stored_flat(
        self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor | None:
        """The flat tensor of the bucket's last :meth:`scatter`, when its buffers are
        still the views it stored (and of ``like``'s dtype and device); else None."""
        hit = self._flats.get(tuple(names))
        if hit is None:
            return None
        flat, views = hit
        if (
            flat.dtype == like.dtype
            and flat.device == like.device
            and all(v.numel() == n for v, n in zip(views, sizes, strict=True))
            and all(self._residuals.get(k) is v for k, v in zip(names, views, strict=True))
        ):
            return flat
        return None

    def stored(
        self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor | None:
        """The flat tensor of the bucket's last :meth:`scatter`, whose views its
        buffers still are (of ``like``'s dtype and device), to read or update in
        place; None when there is none (no step yet, a rebuilt bucket, a loaded
        checkpoint)."""
        return self._stored_flat(names, sizes, like)

    def known_zero(self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor) -> bool:
        """Whether the bucket's buffers are known to hold zeros only (marked by
        :meth:`mark_zero` and not written since), without reading them."""
        version = self._zero.get(tuple(names))
        if version is None:
            return False
        flat = self._stored_flat(names, sizes, like)
        return flat is not None and _version_of(flat) == version

    def mark_zero(self, names: Sequence[str]) -> None:
        """Note that the bucket's last :meth:`scatter` stored zeros only (the caller
        knows: its residual is ``acc - sent`` with every non-zero sent)."""
        key = tuple(names)
        hit = self._flats.get(key)
        version = _version_of(hit[0]) if hit is not None else None
        if version is not None:
            self._zero[key] = version

    def gather(
        self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor:
        """A bucket's flat view: the buffers of ``names`` concatenated (moved to
        ``like``'s device and dtype), zeros where a buffer is missing or of another size.

        Read-only: when the buffers are still the views the bucket's last
        :meth:`scatter` stored (every step of a training run after the first), this
        is that flat tensor itself, not a copy (one pass over the bucket less).
        """
        flat = self._stored_flat(names, sizes, like)
        if flat is not None:
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
            self._zero.pop(other, None)
        self._flats[key] = (flat, views)
        self._zero.pop(key, None)

    def reset(self, name: str | None = None) -> None:
        """Forget one buffer, or all."""
        self._flats.clear()
        self._zero.clear()
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self._flats.clear()
        self._zero.clear()

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
                u.index_fill_(0, sent.indices, 0.0)  # (u is the bucket's flat momentum)
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
                _subtract_at(flat, sent.indices, sent.values.to(acc.dtype))
        else:
            r -= sent.to(acc.dtype)

    def compensate_bucket(
        self, names: Sequence[str], sizes: Sequence[int], g: torch.Tensor
    ) -> torch.Tensor:
        """A bucket's ``acc = residual + g`` (``g`` flat): a new tensor, or ``g``
        itself when the residual is known to be zero (:meth:`known_zero`: the last
        step sent every non-zero), which the caller must then not change. ``0 + g``
        is ``g``'s value, bit for bit, except a ``-0.0`` that stays ``-0.0``: a zero
        either way, never selected, summed or kept."""
        if self.known_zero(names, sizes, g):
            return g
        return self.gather(names, sizes, g) + g

    def update_bucket(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        acc: torch.Tensor,
        sent: torch.Tensor | SparseStream,
        covering: bool = False,
    ) -> None:
        """A bucket's ``residual = acc - sent``, stored by name.

        ``sent`` dense (a flat tensor or a dense stream): a new tensor. A sparse
        stream: ``acc`` itself becomes the residual, the sent entries subtracted in
        place (O(k) instead of two passes over the bucket); the caller gives ``acc``
        up. Either way the same arithmetic: unsent entries keep ``acc``'s value.
        ``covering``: ``sent`` holds every non-zero of ``acc`` with its exact value,
        so the residual is zero, and the next :meth:`compensate_bucket` skips it.
        """
        if isinstance(sent, SparseStream) and not sent.is_dense:
            _subtract_at(acc, sent.indices, sent.values.to(acc.dtype))
            self.scatter(names, sizes, acc)
        else:
            dense = sent.to_dense() if isinstance(sent, SparseStream) else sent
            self.scatter(names, sizes, acc - dense.to(acc.dtype))
        if covering:
            self.mark_zero(names)

    def update_entries(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        acc: SparseStream,
        sent: SparseStream,
        covering: bool = False,
    ) -> None:
        """:meth:`update_bucket` for an ``acc`` given by its entries: ``acc`` holds
        ``residual + g`` wherever either is non-zero (zeros included where they
        cancelled), so writing them into the stored residual (:meth:`stored`, which
        must exist) and subtracting the sent entries leaves ``acc - sent`` there,
        with :meth:`update_bucket`'s arithmetic, in O(nnz) writes. The stored tensor
        changes in place (where :meth:`update_bucket` stores a new one): a buffer
        read from :attr:`buffers` during a step is not a snapshot; clone it, or read
        it between steps, as ``state_dict`` does."""
        like = acc.values
        flat = self.stored(names, sizes, like)
        if flat is None:
            raise RuntimeError(f"no stored residual for bucket {tuple(names)!r} to update")
        flat.index_copy_(0, acc.indices, acc.values.to(flat.dtype))
        _subtract_at(flat, sent.indices, sent.values.to(flat.dtype))
        if covering:
            self.mark_zero(names)


def _subtract_at(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[indices] -= values`` for a 1-D ``flat`` and distinct ``indices``: the
    same subtraction, bit for bit, through ``index_select`` and ``index_copy_``,
    which run faster on the CPU than advanced indexing's read-modify-write
    (``index_put_``)."""
    flat.index_copy_(0, indices, flat.index_select(0, indices).sub_(values))


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write to it or a view of
    it); None for an inference-mode tensor, which keeps none."""
    try:
        return int(t._version)
    except RuntimeError:
        return None
