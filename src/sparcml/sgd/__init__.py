"""The SGD-math layer: error feedback and the per-tensor compressed SGD steps.

* :class:`ErrorFeedback` — residuals per tensor (SparCML Alg. 1, RedSync Alg. 1);
* :func:`topk_sgd_step` — SparCML's quantized TopK SGD step (Alg. 1) for one tensor;
* :func:`oktopk_sgd_step` — Ok-Topk SGD's step for one tensor (paper 001).

Built on the collectives; used by the training integration (:mod:`sparcml.torch`).
"""

from __future__ import annotations

from .feedback import ErrorFeedback
from .oktopk_sgd import oktopk_sgd_step
from .topk_sgd import topk_sgd_step

__all__ = ["ErrorFeedback", "oktopk_sgd_step", "topk_sgd_step"]
