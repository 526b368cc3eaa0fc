"""Error feedback and DGC momentum correction: the residuals the training steps keep.

The one-tensor SGD steps of SparCML (Alg. 1) and Ok-Topk run on the training
pipeline: :func:`sparcml.torch.topk_sgd_step`, :func:`sparcml.torch.oktopk_sgd_step`.
"""

from __future__ import annotations

from .feedback import ErrorFeedback, MomentumCorrection, NamedBuffers

__all__ = ["ErrorFeedback", "MomentumCorrection", "NamedBuffers"]
