"""SparCML's TopK SGD step and Ok-Topk's SGD step for one tensor, on the pipeline.

Adapters for training loops that hold their own residuals
(:class:`~sparcml.sgd.ErrorFeedback`) and call one step per tensor: each hands
the tensor, as a bucket of one parameter, to the same per-group pipeline as the
DDP hook (:func:`~sparcml.torch.reduce.reduce_group`; no warm-up, clipping,
momentum correction or NaN round: ``nan_policy="unchecked"``), with the caller's
residuals and operator, and returns the sum over ranks.
"""

from __future__ import annotations

import torch

from ..collectives import OkTopkState
from ..comm import Communicator, resolve
from ..compress import Quantizer, Selector, get
from ..compress.base import Composed, operator_class
from ..compress.selection import k_of
from ..sgd.feedback import ErrorFeedback
from .methods import OkTopk, TopK
from .reduce import Bucket, reduce_group
from .runtime import Group
from .settings import PipelineSettings

__all__ = ["oktopk_sgd_step", "topk_sgd_step"]

#: no warm-up, clipping or momentum correction; NaN/Inf as the collective carries them
_SETTINGS = PipelineSettings(nan_policy="unchecked")


def _bucket(grad: torch.Tensor, name: str, lr: float | None) -> Bucket:
    # row-major whatever the gradient's layout (residuals index the flat tensor)
    g = grad.detach()
    g = torch.mul(g, lr) if lr is not None else g
    return Bucket((name,), (g.numel(),), g.reshape(-1), 0)


def _name(op: Selector | Quantizer, default: str) -> str:
    return op.name if operator_class(op.name) is type(op) else default


def _run(group: Group, bucket: Bucket, feedback: ErrorFeedback, shape: torch.Size) -> torch.Tensor:
    group.feedback = feedback
    total = reduce_group(group, bucket, average=False)
    name = bucket.names[0]
    feedback.buffers[name] = feedback.buffers[name].view(shape)
    return total.reshape(shape)


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
    """One step of SparCML's quantized TopK SGD (paper 000, Alg. 1) for one tensor.

    For a node ``i`` at step ``t``: 1. ``acc = eps + lr * grad``; 2. ``eps = acc -
    TopK(acc)``; 3. ``g = allreduce(Q(TopK(acc)), SUM)``; 4. the caller applies
    ``v = v - g``. Any selector may stand in for ``TopK`` and any value quantizer
    for ``Q``; as in Alg. 1 the residual keeps ``acc - TopK(acc)`` (the quantization
    error is zero-mean and not fed back).

    Args:
        grad: this rank's gradient of the tensor ``name``.
        name: key of the residual in ``feedback``.
        feedback: the :class:`~sparcml.sgd.ErrorFeedback` holding the residuals.
        comm: the communicator (default: the default process group, or a world of one).
        selector: the sparsifier (default ``topk`` with ``k`` or ``density``).
        k / density: for the default top-k selector.
        quantizer: value quantizer ``Q`` of the selected values, or None; each
            rank's ``Q(TopK(acc))`` is quantized once and the partial sums travel
            exactly (``quantize="contributions"``).
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
    q = get(quantizer) if isinstance(quantizer, str) else quantizer
    # the config names the caller's operators (an unregistered one runs under the
    # name of the kind it is): the group runs the operator itself, set below
    config = TopK(
        selector=_name(selector, "topk"),
        quantizer=None if q is None else _name(q, "natural"),
        algorithm=algorithm,
    )
    bucket = _bucket(grad, name, lr)
    op = selector if q is None else Composed(selector, q)  # type: ignore[arg-type]
    group = Group(config, _SETTINGS, resolve(comm), operators={bucket.key: op})
    return _run(group, bucket, feedback, grad.shape)


def oktopk_sgd_step(
    grad: torch.Tensor,
    name: str,
    feedback: ErrorFeedback,
    state: OkTopkState,
    k: int,
    comm: Communicator | None = None,
    lr: float | None = None,
) -> torch.Tensor:
    """One Ok-Topk SGD step (paper 001, "Ok-Topk parallel SGD algorithm") for one tensor.

    For worker ``i`` at step ``t``: 4. ``acc = eps + lr * G``; 5. ``u, indexes =
    Ok_sparse_allreduce(acc, t, k)``; 6. ``eps = acc - acc(indexes)``; 7. the caller
    applies ``w = w - u / P``.

    Args:
        grad: this rank's gradient of tensor ``name``.
        name: key of the residual in ``feedback``.
        feedback: the :class:`~sparcml.sgd.ErrorFeedback` holding the residuals.
        state: this tensor's :class:`~sparcml.collectives.OkTopkState` (kept across steps).
        k: entries selected locally and kept globally (at least 1).
        comm: the communicator (default: the default process group, or a world of one).
        lr: the learning rate multiplied into the gradient (line 4), or None.

    Returns:
        ``u`` dense, shaped like ``grad``, bitwise identical on every rank.

    Raises:
        ValueError: ``k`` is not in ``1..grad.numel()``.
    """
    n = grad.numel()
    if not 1 <= k <= n:
        raise ValueError(f"oktopk_sgd_step: k must be in 1..{n} (the tensor's entries), got {k}")
    density = k / n
    assert k_of(density, n) == k
    group = Group(OkTopk(density=density, tau=state.tau, tau_prime=state.tau_prime),
                  _SETTINGS, resolve(comm))  # fmt: skip
    bucket = _bucket(grad, name, lr)
    group.method_state[bucket.key] = state
    return _run(group, bucket, feedback, grad.shape)
