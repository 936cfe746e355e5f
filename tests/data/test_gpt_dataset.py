import os

import numpy as np
import pytest

from megatron_p2r.data import gpt_dataset
from megatron_p2r.data.gpt_dataset import GPTDataset
from megatron_p2r.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def reference_indices(sizes, documents, num_samples, seq_length, seed):
    """Megatron-LM's GPTDataset index construction, transcribed loop by loop (C++ helper included)."""
    tokens_per_epoch = sum(int(sizes[d]) for d in documents)
    num_epochs = 1
    while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        num_epochs += 1
    separate = False
    if num_epochs > 1:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_last < int(0.8 * per_epoch)
    rng = np.random.RandomState(seed)

    def doc_index(epochs):
        idx = np.array([d for _ in range(epochs) for d in documents], dtype=np.int32)
        rng.shuffle(idx)
        return idx

    doc_idx = np.concatenate((doc_index(num_epochs - 1), doc_index(1))) if separate else doc_index(num_epochs)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = [(0, 0)]
    position, offset = 0, 0
    for _ in range(total):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        sample_idx.append((position, offset))
    shuffled = before_last if separate else total
    first = np.arange(shuffled, dtype=np.uint32)
    rng.shuffle(first)
    last = np.arange(shuffled, total, dtype=np.uint32)
    if len(last):
        rng.shuffle(last)
    return doc_idx, np.array(sample_idx), np.concatenate((first, last))


def make_dataset(path, lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, size=n) for n in lengths]
    builder = IndexedDatasetBuilder(f"{path}.bin", np.uint16)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(f"{path}.idx")
    return IndexedDataset(str(path)), docs


@pytest.mark.parametrize("case", range(8))
def test_indices_equal_naive_reference(case):
    rng = np.random.default_rng(case)
    sizes = rng.integers(0, 40, size=rng.integers(1, 30)).astype(np.int32)
    sizes[0] = max(sizes[0], 1)
    if case % 2:
        sizes[rng.integers(len(sizes))] = 0  # empty documents must be skipped
    documents = np.sort(rng.choice(len(sizes), size=rng.integers(1, len(sizes) + 1), replace=False))
    if sizes[documents].sum() == 0:
        documents = np.array([0])
    seq_length = int(rng.integers(1, 50))
    tokens = int(sizes[documents].sum())
    num_samples = int(rng.integers(1, 4 * tokens // seq_length + 3))  # often several epochs
    ours = gpt_dataset.build_indices(sizes, documents, num_samples, seq_length, seed=case)
    ref = reference_indices(sizes, documents, num_samples, seq_length, seed=case)
    for a, b, name in zip(ours, ref, ("doc_idx", "sample_idx", "shuffle_idx"), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(ours[1]) - 1 >= num_samples


def test_separate_last_epoch_is_exercised():
    sizes = np.full(10, 10, dtype=np.int32)  # 100 tokens per epoch, 24 samples of 4+1
    documents = np.arange(10)
    for num_samples, separate in [(30, True), (45, False)]:
        ours = gpt_dataset.build_indices(sizes, documents, num_samples, 4, seed=3)
        ref = reference_indices(sizes, documents, num_samples, 4, seed=3)
        for a, b in zip(ours, ref, strict=True):
            np.testing.assert_array_equal(a, b)
        # A separately shuffled last epoch keeps the first epoch's documents in its first half.
        assert (sorted(ours[0][:10].tolist()) == list(range(10))) == separate


def test_samples_cross_documents(tmp_path):
    ds, docs = make_dataset(tmp_path / "c", [7, 0, 3, 12, 1, 9, 5])
    documents = np.array([0, 1, 2, 3, 4, 5, 6])
    data = GPTDataset(ds, documents, num_samples=25, seq_length=6, seed=11, name="t")
    assert len(data) >= 25
    stream = np.concatenate([docs[d] for d in data.doc_idx])
    order = np.asarray(data.shuffle_idx)
    assert sorted(order.tolist()) == list(range(len(data)))
    for idx in range(len(data)):
        sample = data[idx]
        assert sample.dtype == np.int64 and sample.shape == (7,)
        start = int(order[idx]) * 6
        np.testing.assert_array_equal(sample, stream[start : start + 7])
    with pytest.raises(IndexError):
        data[len(data)]


def test_deterministic_by_seed(tmp_path):
    ds, _ = make_dataset(tmp_path / "s", [20] * 10)
    a = GPTDataset(ds, np.arange(10), 30, 8, seed=1)
    b = GPTDataset(ds, np.arange(10), 30, 8, seed=1)
    c = GPTDataset(ds, np.arange(10), 30, 8, seed=2)
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    assert not all(np.array_equal(a[i], c[i]) for i in range(30))


def test_cache_is_reused_and_keyed_by_inputs(tmp_path, monkeypatch):
    ds, _ = make_dataset(tmp_path / "k", [15, 9, 30, 4])
    cache = tmp_path / "cache"
    first = GPTDataset(ds, np.arange(4), 10, 5, seed=0, cache_dir=str(cache), name="train")
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3
    expected = [first[i] for i in range(10)]

    def fail(*args):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "build_indices", fail)
    again = GPTDataset(ds, np.arange(4), 10, 5, seed=0, cache_dir=str(cache), name="train")
    assert isinstance(again.sample_idx, np.memmap)
    assert all(np.array_equal(again[i], expected[i]) for i in range(10))
    monkeypatch.undo()
    for changed in [dict(seed=1), dict(seq_length=6), dict(num_samples=11), dict(documents=np.arange(3))]:
        kwargs = dict(documents=np.arange(4), num_samples=10, seq_length=5, seed=0) | changed
        GPTDataset(ds, cache_dir=str(cache), name="train", **kwargs)
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3 * 5
    # Same prefix, same arguments, different document lengths: a new cache entry.
    (tmp_path / "k.bin").unlink()
    (tmp_path / "k.idx").unlink()
    ds2, _ = make_dataset(tmp_path / "k", [15, 9, 31, 4])
    GPTDataset(ds2, np.arange(4), 10, 5, seed=0, cache_dir=str(cache), name="train")
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3 * 6


def test_documents_without_tokens_is_an_error(tmp_path):
    ds, _ = make_dataset(tmp_path / "z", [0, 0, 5])
    with pytest.raises(ValueError, match="hold no tokens"):
        GPTDataset(ds, np.array([0, 1]), 3, 4, seed=0)
