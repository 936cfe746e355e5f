import os

import numpy as np
import pytest

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.blended import BlendedDataset
from megatron_p2r.data.builder import build_train_valid_test_datasets, parse_data_path, parse_split, split_ranges
from megatron_p2r.data.gpt_dataset import GPTDataset
from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder


def write_corpus(prefix, num_docs, base=0):
    """Document i is 5 + i % 7 copies of the token base + i, so a sample tells which documents it used."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for i in range(num_docs):
        builder.add_document(np.full(5 + i % 7, base + i))
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_parsers():
    assert parse_data_path(["A"]) == (["A"], [1.0])
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_split("8,1,1") == pytest.approx([0.8, 0.1, 0.1])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("'99,1,0'") == parse_split("99,1,0")  # quotes a bash array leaves in argv
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    for bad, message in [
        (["A", "B"], "expected a weight before B"),
        (["0.3", "A", "B"], "weight/prefix pairs"),
        (["0", "A", "1", "B"], "must be positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_data_path(bad)
    for bad in ["a,b", "1,2,3,4", "0,0,0", "-1,2", "nan,1", "inf,1,0", "1e308,1e308"]:
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def test_splits_use_disjoint_documents(tmp_path):
    prefix = write_corpus(tmp_path / "c", 100)
    cfg = DataConfig(data_path=[prefix], split="8,1,1")
    train, valid, test = build_train_valid_test_datasets(cfg, seq_length=8, seed=1, num_samples=(50, 10, 0))
    assert isinstance(train, GPTDataset) and test is None
    assert len(train) >= 50 and len(valid) >= 10
    assert all(x.shape == (9,) and x.dtype == np.int64 for x in (train[0], valid[0]))
    assert set(np.concatenate([train[i] for i in range(len(train))]).tolist()) <= set(range(80))
    assert set(np.concatenate([valid[i] for i in range(len(valid))]).tolist()) <= set(range(80, 90))
    cache = tmp_path / "cache" / "GPTDataset_indices"  # default: beside the data
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 6


def test_empty_split_requested_is_a_clear_error(tmp_path):
    prefix = write_corpus(tmp_path / "c", 100)
    cfg = DataConfig(data_path=[prefix], split="969,30,1")
    with pytest.raises(ConfigError, match=r"--split 969,30,1: the test split of --data-path .*c has 0 of its 100"):
        build_train_valid_test_datasets(cfg, 8, 1, (10, 2, 1))
    train, valid, test = build_train_valid_test_datasets(cfg, 8, 1, (10, 2, 0))
    assert test is None and len(valid) >= 2


def test_blending_two_prefixes(tmp_path):
    a = write_corpus(tmp_path / "a", 40)
    b = write_corpus(tmp_path / "b", 40, base=1000)
    cache = tmp_path / "my_cache"
    cfg = DataConfig(data_path=["0.3", a, "0.7", b], split="1,0,0", data_cache_path=str(cache))
    train, valid, test = build_train_valid_test_datasets(cfg, 6, 0, (100, 0, 0))
    assert isinstance(train, BlendedDataset) and valid is None and len(train) == 100
    from_a = [bool(train[i].max() < 1000) for i in range(100)]
    assert sum(from_a) == 30
    assert sum(from_a[:10]) == 3
    assert all(train[i].min() >= 1000 for i in range(100) if not from_a[i])
    assert os.listdir(cache) and not os.path.exists(tmp_path / "cache")


def test_missing_and_corrupt_files_name_the_path(tmp_path):
    cfg = DataConfig(data_path=[str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match=r"--data-path .*nope: .*nope\.idx not found"):
        build_train_valid_test_datasets(cfg, 8, 0, (1, 0, 0))
    prefix = write_corpus(tmp_path / "c", 10)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"xx")
    with pytest.raises(ConfigError, match=r"--data-path .*c: .*c\.bin: \d+ bytes"):
        build_train_valid_test_datasets(DataConfig(data_path=[prefix]), 8, 0, (1, 0, 0))
