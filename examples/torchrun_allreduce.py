"""The README's torchrun example, runnable.

Run: .venv/bin/torchrun --nproc-per-node 4 examples/torchrun_allreduce.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import sparcml
import sparcml.torch


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    grad = torch.randn(1_000_000, generator=torch.Generator().manual_seed(rank))
    k = 10_000
    top = grad.abs().topk(k).indices  # your sparsifier
    stream = sparcml.SparseStream(top, grad[top], grad.numel())

    total = sparcml.sparse_allreduce(stream)  # algorithm="auto"
    dense = torch.zeros(grad.numel())
    dense[top] = grad[top]
    dist.all_reduce(dense)
    assert torch.allclose(total.to_dense(), dense, atol=1e-5)

    # SparCML Alg. 1: error feedback + top-k + quantized values, one call per tensor
    ef = sparcml.ErrorFeedback()
    g = sparcml.torch.topk_sgd_step(grad, "w", ef, density=0.01, quantizer="natural", lr=0.1)

    work = sparcml.sparse_allreduce(stream, async_op=True)  # non-blocking
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # compute meanwhile
    assert work.wait().equal(total)

    checks = torch.tensor([total.nnz, int(g.count_nonzero())], dtype=torch.int64)
    gathered = [torch.zeros_like(checks) for _ in range(world)]
    dist.all_gather(gathered, checks)
    if rank == 0:
        print(f"{world} ranks: result nnz {total.nnz}, Alg. 1 update nnz {int(g.count_nonzero())}")
        print("identical on every rank:", all(torch.equal(c, gathered[0]) for c in gathered))
    del busy
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
