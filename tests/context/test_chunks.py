"""The load-balanced chunk assignment (context/chunks.py) and the data path built on it, without
processes: which positions each CP rank holds, equal causal work, each rank's tokens, labels and
loss mask, and the loss put back together exactly."""

import pytest
import torch

from megatron_p2r.context.chunks import chunk_positions, split_batch, split_sequence
from megatron_p2r.data.mock import MockGPTDataset
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training.data import microbatch_iterator
from tests.helpers import tiny_config


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_each_rank_holds_chunks_i_and_its_mirror(cp):
    seq = 2 * cp * 3
    held = [chunk_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))  # every position once
    c = seq // (2 * cp)
    for r, positions in enumerate(held):
        assert positions.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]


def causal_work(positions: torch.Tensor) -> int:
    """Query-key pairs a causal attention computes for queries at ``positions``: sum of p + 1."""
    return int((positions + 1).sum())


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_work_is_equal_on_every_rank(cp):
    """Each rank computes the same number of query-key pairs under the causal mask (a
    contiguous split gives the last rank 2CP-1 times the first's)."""
    seq = 2 * cp * 5
    work = [causal_work(chunk_positions(seq, cp, r)) for r in range(cp)]
    assert len(set(work)) == 1
    assert sum(work) == seq * (seq + 1) // 2


def test_a_sequence_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        chunk_positions(16, 3, 0)


def test_split_batch_takes_the_positions_of_every_sequence_tensor():
    b, s, cp = 3, 16, 4
    batch = {
        "tokens": torch.arange(b * s).view(b, s),
        "labels": torch.arange(b * s).view(b, s) + 1,
        "loss_mask": (torch.rand(b, s) > 0.3).float(),
    }
    for r in range(cp):
        pos = chunk_positions(s, cp, r)
        mine = split_batch(batch, cp, r)
        for key, full in batch.items():
            assert torch.equal(mine[key], full[:, pos]), key
    assert split_sequence(batch["tokens"], 1, 0) is batch["tokens"]


def test_each_cp_rank_reads_its_chunks_of_the_same_samples():
    """The data loader: the CP ranks of a DP rank read the same samples, each its chunks of tokens,
    labels and loss mask; together they are the one-process micro-batch."""
    cfg = tiny_config(seq_length=16, micro_batch_size=2, context_parallel_size=2)
    dataset = MockGPTDataset(8, 16, cfg.model.vocab_size, 1)
    single = next(microbatch_iterator(dataset, 0, cfg, ParallelState.single()))
    for r in range(2):
        ps = ParallelState(layout=Layout(cp=2), rank=r)
        mine = next(microbatch_iterator(dataset, 0, cfg, ps))
        pos = chunk_positions(16, 2, r)
        assert mine.keys() == single.keys()
        for key in single:
            assert torch.equal(mine[key], single[key][:, pos]), key


def test_the_loss_sums_over_cp_ranks_to_the_one_process_token_mean():
    """Each CP rank's masked sum and mask count (the numerator and denominator the step sums over
    the DP x CP ranks: pipeline/token_loss.py) add up to the whole sequence's token mean, whatever
    the loss mask."""
    cfg = tiny_config(seq_length=16)
    model = build_model(cfg, ParallelState.single())
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": (torch.rand(2, 16, generator=g) > 0.4).float()}
    with torch.no_grad():
        per_token = model(tokens=batch["tokens"], labels=batch["labels"])
    want = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    num = den = 0.0
    for r in range(4):
        mine = split_batch(batch, 4, r)
        num = num + (split_sequence(per_token, 4, r) * mine["loss_mask"]).sum()
        den = den + mine["loss_mask"].sum()
    torch.testing.assert_close(num / den, want)
