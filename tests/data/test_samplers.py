import itertools

import numpy as np
import pytest

from megatron_p2r.data.mock import MockGPTDataset
from megatron_p2r.data.samplers import PretrainingSampler


def megatron_sampler(total, consumed, mb, rank, dp, drop_last=True):
    """Megatron-LM's MegatronPretrainingSampler.__iter__, transcribed."""
    batch = []
    start, end = rank * mb, (rank + 1) * mb
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mb * dp:
            yield batch[start:end]
            batch = []
    if len(batch) > 0 and not drop_last:
        yield batch[start:end]


@pytest.mark.parametrize(
    "total,consumed,mb,dp", [(50, 0, 2, 3), (50, 7, 2, 3), (17, 0, 4, 1), (9, 8, 1, 2), (64, 32, 8, 4)]
)
@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_megatron(total, consumed, mb, dp, drop_last):
    for rank in range(dp):
        ours = list(PretrainingSampler(total, consumed, mb, rank, dp, drop_last=drop_last))
        assert ours == list(megatron_sampler(total, consumed, mb, rank, dp, drop_last))


def test_ranks_split_each_step():
    mb, dp = 3, 4
    per_rank = [list(PretrainingSampler(120, 0, mb, r, dp)) for r in range(dp)]
    for step, batches in enumerate(zip(*per_rank, strict=True)):
        flat = [i for b in batches for i in b]
        assert flat == list(range(step * mb * dp, (step + 1) * mb * dp))
        assert all(len(b) == mb for b in batches)


def test_resume_continues_exactly():
    mb, dp, total = 2, 2, 40
    data = MockGPTDataset(total, 8, 50, seed=5)
    for rank in range(dp):
        full = list(PretrainingSampler(total, 0, mb, rank, dp))
        for steps_done in (1, 4, 9):
            resumed = list(PretrainingSampler(total, steps_done * mb * dp, mb, rank, dp))
            assert resumed == full[steps_done:]
            for a, b in zip(resumed, full[steps_done:], strict=True):
                assert all(np.array_equal(data[i], data[j]) for i, j in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 1, 0, 1), "total_samples"),
        ((10, 10, 1, 0, 1), "consumed_samples"),
        ((10, 0, 0, 0, 1), "micro_batch_size"),
        ((10, 0, 1, 2, 2), "data_parallel_rank"),
    ],
)
def test_errors(args, message):
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(*args)


def test_len_is_total():
    assert len(PretrainingSampler(33, 5, 2, 0, 2)) == 33
    assert list(itertools.islice(PretrainingSampler(33, 5, 2, 1, 2), 2)) == [[7, 8], [11, 12]]
