import numpy as np
import pytest

from megatron_p2r.data.mock import MAX_STEP, MockGPTDataset


def test_deterministic_and_order_independent():
    a = MockGPTDataset(100, 16, 1000, seed=3)
    b = MockGPTDataset(100, 16, 1000, seed=3)
    forward = [a[i] for i in range(100)]
    backward = [b[i] for i in reversed(range(100))][::-1]
    assert all(np.array_equal(x, y) for x, y in zip(forward, backward, strict=True))
    other = MockGPTDataset(100, 16, 1000, seed=4)
    assert not all(np.array_equal(a[i], other[i]) for i in range(100))
    assert len({tuple(x[:2]) for x in forward}) > 90  # samples differ from each other


def test_samples_are_learnable_progressions():
    vocab = 37
    data = MockGPTDataset(50, 20, vocab, seed=0)
    for i in range(50):
        x = data[i]
        assert x.dtype == np.int64 and x.shape == (21,)
        assert x.min() >= 0 and x.max() < vocab
        step = (x[1] - x[0]) % vocab
        assert 1 <= step <= MAX_STEP
        assert np.array_equal(np.diff(x) % vocab, np.full(20, step))  # every next token follows from two


def test_bounds_and_errors():
    data = MockGPTDataset(3, 4, 2, seed=0)
    assert len(data) == 3
    with pytest.raises(IndexError):
        data[3]
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        MockGPTDataset(3, 4, 1, seed=0)
