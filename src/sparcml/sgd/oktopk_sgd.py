"""Ok-Topk SGD (paper 001, "Ok-Topk parallel SGD algorithm") as one call per tensor.

For worker ``i`` at step ``t``:

4. ``acc = eps + lr * G``                          (accumulate residuals)
5. ``u, indexes = Ok_sparse_allreduce(acc, t, k)``
6. ``eps = acc - acc(indexes)``                    (update residuals)
7. the caller applies ``w = w - u / P``.
"""

from __future__ import annotations

import torch

from ..collectives.oktopk import OkTopkState, oktopk_allreduce
from ..comm import Communicator, resolve
from ..stream import SparseStream
from .feedback import ErrorFeedback

__all__ = ["oktopk_sgd_step"]


def oktopk_sgd_step(
    grad: torch.Tensor,
    name: str,
    feedback: ErrorFeedback,
    state: OkTopkState,
    k: int,
    comm: Communicator | None = None,
    lr: float | None = None,
) -> torch.Tensor:
    """One Ok-Topk SGD step for one tensor; returns ``u`` (apply ``w -= u / P``).

    Args:
        grad: this rank's gradient of tensor ``name``.
        name: key of the residual in ``feedback``.
        feedback: the :class:`~sparcml.ErrorFeedback` holding the residuals.
        state: this tensor's :class:`~sparcml.collectives.OkTopkState` (kept across steps).
        k: entries selected locally and kept globally.
        comm: the communicator (default: the default process group, or a world of one).
        lr: the learning rate multiplied into the gradient (line 4), or None.

    Returns:
        ``u`` dense, shaped like ``grad``, bitwise identical on every rank.
    """
    comm = resolve(comm)
    # Line 4: accumulate residuals
    acc = feedback.compensate(grad, name, lr)
    # Line 5: Ok-Topk sparse allreduce
    result = oktopk_allreduce(acc, k, comm, state)
    # Line 6: eps = acc - acc(indexes)
    flat = acc.reshape(-1)
    idx = result.local_indices
    feedback.update(acc, SparseStream.from_sorted(idx, flat[idx], flat.numel()), name)
    return result.stream.to_dense().reshape(grad.shape)
