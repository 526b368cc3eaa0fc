"""Ranks round independently: the error of the mean falls as 1/P.

P ranks quantize the *same* vector and the collective averages them. With
independent rounding the mean's squared error is ``sigma^2 / P``; with every
rank drawing the same random stream (as when every rank used seed 0) it stays
``sigma^2`` whatever P. For every stochastic quantizer, through every exact
algorithm under ``quantize="contributions"`` (SparCML's Alg. 1: each rank's
contribution quantized once, partial sums exact) and through the training
pipeline (the DDP hook's ``reduce_bucket``, via ``sync_gradients``).

Tolerance: each figure is a sum of 2048 independent per-entry errors, averaged
over 3 trials (relative standard error a few percent); the bands below are
+-25%, about 5 standard errors. The split algorithms quantize each rank's
``N/P``-long pieces separately (a finer bucketing for QSGD and dithering), so
their error may fall faster than 1/P, never slower.
"""

from __future__ import annotations

import pytest
import torch

import sparcml.torch as st
from sparcml import SparseStream, algorithms, compress, sparse_allreduce
from sparcml.comm import run_ranks

N = 2048
QUANTIZERS = ["natural", "qsgd", "dithering", "natural_dithering"]
X = torch.randn(N, generator=torch.Generator().manual_seed(1))
# auto: any; twolevel_shard splits into the node's ranks' shards (here one node)
SPLIT = ("ssar_split_allgather", "dsar_split_allgather", "topkdsa", "twolevel_shard", "auto")


def _error_of_mean(world: int, quantizer: str, algorithm: str, trials: int = 3) -> float:
    total = 0.0
    for t in range(trials):

        def fn(comm, t=t):  # type: ignore[no-untyped-def]
            for _ in range(t):  # later trials: later calls, other random numbers
                comm.next_sequence()
            s = SparseStream.dense(X.clone())
            out = sparse_allreduce(
                s, comm, algorithm=algorithm, quantizer=compress.get(quantizer),
                quantize="contributions",
            )  # fmt: skip
            return out.to_dense()

        out = run_ranks(world, fn)
        assert all(torch.equal(o, out[0]) for o in out)
        total += float(((out[0] / world - X) ** 2).sum())
    return total / trials


def _single_error(quantizer: str, trials: int = 3) -> float:
    total = 0.0
    for t in range(trials):
        q = compress.get(quantizer, seed=100 + t)
        payload, ctx = q.compress(X)
        total += float(((q.decompress(payload, ctx) - X) ** 2).sum())
    return total / trials


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize(
    "algorithm",
    [a for a in algorithms(exact=True, variants=False) if a != "dense"] + ["auto_lossy"],
)
def test_error_of_the_mean_falls_as_one_over_p(quantizer: str, algorithm: str) -> None:
    alg = "auto" if algorithm == "auto_lossy" else algorithm
    e2, e8 = _error_of_mean(2, quantizer, alg), _error_of_mean(8, quantizer, alg)
    sigma2 = _single_error(quantizer)
    assert e2 > 0 and e8 > 0
    if alg in SPLIT:  # finer pieces: at least as fast as 1/P
        assert e2 <= 1.25 * sigma2 / 2 and e8 <= 1.25 * e2 / 4, (e2, e8, sigma2)
    else:
        assert 0.75 * sigma2 / 2 <= e2 <= 1.25 * sigma2 / 2, (e2, sigma2)
        assert 0.75 * e2 / 4 <= e8 <= 1.25 * e2 / 4, (e2, e8)


@pytest.mark.parametrize("quantizer", ["natural", "qsgd"])
def test_training_pipeline_rounds_independently(quantizer: str) -> None:
    # The DDP hook's pipeline (reduce_bucket) with topk+Q at density 1: every rank
    # sends Q(its gradient) once; the mean's error falls as 1/P.
    def run(world: int) -> float:
        def fn(comm):  # type: ignore[no-untyped-def]
            p = torch.nn.Parameter(torch.zeros(N))
            p.grad = X.clone()
            state = st.SparcmlState(f"topk+{quantizer}", density=1.0, comm=comm, seed=0)
            st.sync_gradients([p], state)
            return p.grad.clone()

        out = run_ranks(world, fn)
        assert all(torch.equal(o, out[0]) for o in out)
        return float(((out[0] - X) ** 2).sum())

    e2, e8 = run(2), run(8)
    assert 0.6 * e2 / 4 <= e8 <= 1.4 * e2 / 4, (e2, e8)
