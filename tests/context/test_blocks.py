"""The block rules against the dense one-process mask, without processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_p2r.context.blocks import Block, allowed, block_kind, rank_chunks, step_blocks
from megatron_p2r.context.chunks import chunk_positions
from megatron_p2r.model.attention import window_mask


def _dense(q_start, k_start, length, window):
    """The one-process mask's [length, length] block (model.attention.window_mask)."""
    seq = max(q_start, k_start) + length
    full = window_mask(seq, seq if window is None else window, torch.device("cpu"))
    return full[q_start : q_start + length, k_start : k_start + length]


@pytest.mark.parametrize("window", [None, 0, 1, 2, 3, 4, 5, 7, 8, 11, 12, 13])
def test_block_kind_agrees_with_the_dense_mask(window):
    length = 4
    for q_chunk, k_chunk in itertools.product(range(6), repeat=2):
        q0, k0 = q_chunk * length, k_chunk * length
        dense = _dense(q0, k0, length, window)
        kind = block_kind(q0, k0, length, window)
        where = f"q chunk {q_chunk}, k chunk {k_chunk}, window {window}: {kind}"
        assert (kind is Block.SKIP) == (not dense.any()), where
        assert (kind is Block.FULL) == bool(dense.all()), where
        if kind is Block.CAUSAL:
            assert torch.equal(dense, torch.ones(length, length, dtype=torch.bool).tril()), where
        positions = torch.arange(length)
        assert torch.equal(allowed(q0 + positions, k0 + positions, window), dense), where


def test_diagonal_block_is_causal_unless_the_window_cuts_it():
    assert block_kind(8, 8, 4) is Block.CAUSAL
    assert block_kind(8, 8, 4, window=3) is Block.CAUSAL
    assert block_kind(8, 8, 4, window=2) is Block.MASKED


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_hold_load_balanced_chunks_covering_the_sequence(size):
    chunks = [rank_chunks(r, size) for r in range(size)]
    assert sorted(c for pair in chunks for c in pair) == list(range(2 * size))
    assert {a + b for a, b in chunks} == {2 * size - 1}
    # the ring's chunks are the ones the data loader hands each rank (context.chunks)
    for r, (first, second) in enumerate(chunks):
        expected = list(range(3 * first, 3 * first + 3)) + list(range(3 * second, 3 * second + 3))
        assert chunk_positions(6 * size, size, r).tolist() == expected


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_ring_visits_every_visible_block_once(size, window):
    """Over its N steps each rank computes each (its query chunk, any key chunk) pair the mask
    does not skip exactly once."""
    chunk = 4
    for rank in range(size):
        seen = []
        for step in range(size):
            source = rank_chunks((rank - step) % size, size)
            seen += [
                (rank_chunks(rank, size)[x], source[y]) for x, y, _ in step_blocks(rank, size, step, chunk, window)
            ]
        visible = [
            (q, k)
            for q in rank_chunks(rank, size)
            for k in range(2 * size)
            if block_kind(q * chunk, k * chunk, chunk, window) is not Block.SKIP
        ]
        assert sorted(seen) == sorted(visible), (rank, window)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_rank_does_the_same_causal_work(size):
    """In chunk x chunk units (a causal diagonal block is half): 2N per rank, the 2N^2 of the
    whole causal square shared evenly."""
    cost = {Block.FULL: 1.0, Block.CAUSAL: 0.5}
    work = [
        sum(cost[kind] for step in range(size) for _, _, kind in step_blocks(rank, size, step, 4))
        for rank in range(size)
    ]
    assert work == [2.0 * size] * size
