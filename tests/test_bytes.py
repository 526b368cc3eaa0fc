"""Bytes on the wire, measured by the communicator, against the paper's bounds (sec. 5.3).

N < 65536 and float32, so one pair is c + isize = 2 + 4 = 6 bytes with the paper's
fixed index fields (``index_coding="fixed"``); every encoded stream adds a 24-byte
header, every bundle 8 + 12 bytes per entry. The default coding sends the same
pairs with Elias--Fano index fields where they are smaller (the last test).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparcml import SparseStream
from sparcml.collectives.codec import StreamCodec
from sparcml.collectives.dense import dense_allreduce
from sparcml.collectives.dsar_split_allgather import dsar_split_allgather
from sparcml.collectives.ssar_recursive_double import ssar_recursive_double
from sparcml.collectives.ssar_split_allgather import ssar_split_allgather
from sparcml.comm import run_ranks
from sparcml.indexcode import layout

PAIR = 6
N = 60_000
K = 500


def _streams(pattern: str, rank: int, world: int) -> SparseStream:
    if pattern == "identical":
        idx = torch.randperm(N, generator=torch.Generator().manual_seed(1))[:K]
    else:  # disjoint, spread evenly over the whole index space
        mine = torch.arange(rank, N, world)
        idx = mine[torch.linspace(0, mine.numel() - 1, K).long()]
    return SparseStream(idx, torch.ones(K), N)


def _sent(world: int, pattern: str, algorithm, coding: str = "fixed"):  # type: ignore[no-untyped-def]
    def fn(comm):  # type: ignore[no-untyped-def]
        s = _streams(pattern, comm.rank, world)
        comm.stats.reset()
        if algorithm is dense_allreduce:
            algorithm(s, comm)
        else:
            algorithm(s, comm, codec=StreamCodec(index_coding=coding))
        return comm.stats.snapshot()

    return run_ranks(world, fn)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_recursive_doubling_between_log_p_k_and_p_minus_1_k(world: int) -> None:
    stages = int(math.log2(world))
    for st in _sent(world, "identical", ssar_recursive_double):
        # fully overlapping sets: k pairs per stage, the lower bound log2(P) k
        assert st.bytes_sent == stages * (24 + K * PAIR)
        assert st.messages_sent == stages
    for st in _sent(world, "disjoint", ssar_recursive_double):
        # disjoint sets: 2^(t-1) k pairs at stage t, the upper bound (P-1) k
        assert st.bytes_sent == (world - 1) * K * PAIR + stages * 24


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_recursive_doubling_non_power_of_two_stays_bounded(world: int) -> None:
    # Appendix A's fold and unfold add one message each: the folded rank's k pairs
    # ride along in each of the log2(P') stages, and the whole result (P k pairs)
    # is handed back: at most (P - 1 + log2(P') + P) k pairs.
    stages = world.bit_length() - 1
    for st in _sent(world, "disjoint", ssar_recursive_double):
        assert st.bytes_sent <= (2 * world - 1 + stages) * K * PAIR + (stages + 2) * 24


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_split_allgather_bounds(world: int) -> None:
    overhead = 24 * 2 * world + 20 * world * world  # stream headers and bundle tables
    ident = _sent(world, "identical", ssar_split_allgather)
    mean = sum(s.bytes_sent for s in ident) / world
    lower = 2 * (world - 1) / world * K * PAIR
    # fully overlapping: the mean rank sends exactly the lower bound 2(P-1)/P k pairs
    assert lower <= mean <= lower + overhead
    for st in _sent(world, "disjoint", ssar_split_allgather):
        assert st.bytes_sent <= world * K * PAIR + overhead  # upper bound P k


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_dsar_sends_sparse_split_then_dense_range(world: int) -> None:
    width = math.ceil(N / world)
    for st in _sent(world, "disjoint", dsar_split_allgather):
        dense_part = (world - 1) * width * 4
        assert dense_part <= st.bytes_sent <= dense_part + K * PAIR + 24 * world


@pytest.mark.parametrize("world", [2, 4, 5])
def test_dense_ring_sends_2_p_minus_1_over_p_n(world: int) -> None:
    stats = _sent(world, "disjoint", dense_allreduce)
    total = sum(s.bytes_sent for s in stats)
    assert total == 2 * (world - 1) * N * 4


@pytest.mark.parametrize("world", [2, 4, 8])
def test_elias_fano_fields_send_fewer_bytes(world: int) -> None:
    # fully overlapping sets: every stage carries the same k indices, now in the
    # Elias-Fano field of 500 indices below 60,000 (l = 6: 9 bits instead of 16)
    field = layout(N, K)
    assert field.coding == "elias-fano" and field.nbytes * 8 / K <= 9
    stages = int(math.log2(world))
    for st in _sent(world, "identical", ssar_recursive_double, coding="auto"):
        assert st.bytes_sent == stages * (24 + field.nbytes + K * 4)
