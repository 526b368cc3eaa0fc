"""SparCML's quantized TopK SGD step (paper 000, Alg. 1) as one call.

For a node ``i`` at step ``t``:

1. ``acc = eps + lr * grad``            (accumulate the error into the gradient)
2. ``eps = acc - TopK(acc)``            (update the error)
3. ``g = allreduce(Q(TopK(acc)), SUM)`` (sum the sparse contributions of all nodes)
4. the caller applies ``v = v - g``.

Any selector may stand in for ``TopK`` and any value quantizer for ``Q`` (the
identity when none is given). As in Alg. 1 the residual keeps ``acc - TopK(acc)``:
the quantization error itself is not fed back (it is zero-mean).
"""

from __future__ import annotations

import torch

from ..collectives import sparse_allreduce
from ..comm import Communicator
from ..compress import Quantizer, Selector, get
from .feedback import ErrorFeedback

__all__ = ["topk_sgd_step"]


def topk_sgd_step(
    grad: torch.Tensor,
    name: str,
    feedback: ErrorFeedback,
    comm: Communicator | None = None,
    *,
    selector: Selector | None = None,
    k: int | None = None,
    density: float | None = None,
    quantizer: Quantizer | str | None = None,
    lr: float | None = None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """One step of quantized TopK SGD for one tensor; returns the summed update ``g``.

    Args:
        grad: this rank's gradient of the tensor ``name``.
        name: key of the residual in ``feedback``.
        feedback: the :class:`ErrorFeedback` holding the residuals.
        comm: the communicator (default: the default process group, or a world of one).
        selector: the sparsifier (default ``topk`` with ``k`` or ``density``).
        k / density: for the default top-k selector.
        quantizer: value quantizer ``Q`` applied to the selected values, or None.
            As in Alg. 1, each rank's ``Q(TopK(acc))`` is quantized once and the
            partial sums travel exactly (``quantize="contributions"``).
        lr: the learning rate ``alpha`` of Alg. 1 (multiplied into the gradient),
            or None to accumulate raw gradients and apply ``lr`` yourself.
        algorithm: sparse allreduce algorithm (``"auto"``).

    Returns:
        ``g``, dense, shaped like ``grad``, bitwise identical on every rank.

    Example:
        >>> ef = ErrorFeedback()
        >>> g = topk_sgd_step(torch.tensor([0.1, -2.0, 0.3]), "w", ef, k=1)
        >>> g.tolist(), ef.residual("w").tolist()
        ([0.0, -2.0, 0.0], [0.10000000149011612, 0.0, 0.30000001192092896])
    """
    if selector is None:
        selector = get("topk", k=k, density=density)  # type: ignore[assignment]
    elif k is not None or density is not None:
        raise ValueError("give k/density or a selector, not both")
    assert selector is not None
    # Step 1: accumulate the error into the gradient
    acc = feedback.compensate(grad, name, lr)
    selected = selector.select(acc)
    # Step 2: update the error
    feedback.update(acc, selected, name)
    # Step 3: sum Q(TopK(acc)) over all nodes
    total = sparse_allreduce(
        selected,
        comm,
        algorithm=algorithm,
        quantizer=quantizer,
        quantize="contributions" if quantizer is not None else "dense",
    )
    return total.to_dense().reshape(grad.shape)
