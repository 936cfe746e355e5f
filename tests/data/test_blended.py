import numpy as np
import pytest

from megatron_p2r.data.blended import BlendedDataset, build_blending_indices


def reference_blending(weights, size):
    """Megatron-LM's build_blending_indices (C++ helper), transcribed."""
    weights = [w / sum(weights) for w in weights]
    current = [0] * len(weights)
    dataset_index, sample_index = [], []
    for i in range(size):
        step = max(float(i), 1.0)
        errors = [w * step - c for w, c in zip(weights, current, strict=True)]
        best = errors.index(max(errors))
        dataset_index.append(best)
        sample_index.append(current[best])
        current[best] += 1
    return dataset_index, sample_index


@pytest.mark.parametrize("seed", range(5))
def test_equals_megatron_reference(seed):
    rng = np.random.default_rng(seed)
    weights = (rng.random(rng.integers(1, 6)) + 0.01).tolist()
    ours = build_blending_indices(weights, 500)
    ref = reference_blending(weights, 500)
    assert ours[0].tolist() == ref[0] and ours[1].tolist() == ref[1]


def test_proportions_exact_over_every_prefix_and_window():
    weights = [0.3, 0.7]
    dataset_index, _ = build_blending_indices(weights, 1000)
    counts = np.cumsum(np.eye(2)[dataset_index], axis=0)
    n = np.arange(1, 1001)[:, None]
    assert counts[-1].tolist() == [300, 700]
    assert np.abs(counts - np.array(weights) * n).max() <= 1
    for window in (3, 10, 97):
        in_window = counts[window:] - counts[:-window]
        assert np.abs(in_window - np.array(weights) * window).max() <= 1 + 1e-9
    assert dataset_index[:10].tolist().count(0) == 3


@pytest.mark.parametrize("seed", range(3))
def test_many_datasets_stay_within_two_samples_of_share(seed):
    rng = np.random.default_rng(seed)
    weights = rng.random(5) + 0.01
    weights /= weights.sum()
    dataset_index, sample_index = build_blending_indices(weights, 3000)
    counts = np.cumsum(np.eye(5)[dataset_index], axis=0)
    assert np.abs(counts - weights * np.arange(1, 3001)[:, None]).max() < 2
    for window in (7, 50, 333):
        assert np.abs(counts[window:] - counts[:-window] - weights * window).max() < 2
    for d in range(5):  # each dataset's samples are taken in order 0, 1, 2, ...
        taken = sample_index[dataset_index == d]
        assert taken.tolist() == list(range(len(taken)))


def test_blended_dataset_reads_the_chosen_samples(tmp_path):
    a = [np.full(3, i) for i in range(10)]
    b = [np.full(3, 100 + i) for i in range(10)]
    blend = BlendedDataset([a, b], [1, 3], 12, cache_dir=str(tmp_path))
    assert len(blend) == 12
    firsts = [int(blend[i][0]) for i in range(12)]
    assert sorted(firsts) == [0, 1, 2] + [100 + i for i in range(9)]
    cached = BlendedDataset([a, b], [1, 3], 12, cache_dir=str(tmp_path))
    assert isinstance(cached.dataset_index, np.memmap)
    assert [int(cached[i][0]) for i in range(12)] == firsts
    with pytest.raises(IndexError):
        blend[12]


def test_blended_dataset_errors():
    with pytest.raises(ValueError, match="has 2 samples, the blend needs 5"):
        BlendedDataset([[0] * 2, [0] * 10], [0.5, 0.5], 10)
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset([[0], [0]], [1, -1], 1)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([[0], [0]], [1], 1)
