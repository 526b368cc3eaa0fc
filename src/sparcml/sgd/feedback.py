"""Error feedback: keep what compression did not send and add it to the next gradient.

SparCML's Alg. 1 (paper 000): ``acc_t = eps_(t-1) + lr * grad_t``, send
``TopK(acc_t)``, keep ``eps_t = acc_t - TopK(acc_t)``. RedSync's residual
gradient compression (paper 002, Alg. 1) and Ok-Topk SGD keep residuals the same
way. :class:`ErrorFeedback` holds one residual tensor per name (a parameter, a
DDP bucket), reused in place: memory does not grow over steps.

Invariant (tested in float64): ``acc == sent + residual`` after :meth:`update`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..stream import SparseStream

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residuals per tensor name.

    Example:
        >>> ef = ErrorFeedback()
        >>> acc = ef.compensate(torch.tensor([3.0, 0.1]), "w")
        >>> ef.update(acc, torch.tensor([3.0, 0.0]), "w")
        >>> ef.residual("w").tolist()
        [0.0, 0.10000000149011612]
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

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

    def reset(self, name: str | None = None) -> None:
        """Forget one residual, or all."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}

    def __len__(self) -> int:
        return len(self._residuals)
