"""Token ids are checked against the vocabulary before training: the range of a dataset is one
pass over its .bin, cached beside the sample indices; an id past the vocabulary is one error
line on every layout instead of an IndexError (TP1) or training on another shard's rows (TP2)."""

import os

import numpy as np
import pytest

from megatron_p2r.data import indexed_dataset
from megatron_p2r.data.gpt_dataset import token_range
from megatron_p2r.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.reliability.common import FLAGS, launch

TRAIN = [f for f in FLAGS if f != "--mock-data"] + ["--train-iters", "1", "--split", "1,1,0", "--eval-iters", "1"]


def _dataset(prefix, high, dtype=np.uint16, docs=40):
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    rng = np.random.default_rng(0)
    for d in range(docs):
        b.add_document(rng.integers(0, 150, 30))
    b.add_document([high])
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_the_range_is_computed_once_and_cached(tmp_path, monkeypatch):
    prefix = _dataset(tmp_path / "ds", high=199)
    cache = str(tmp_path / "cache")
    assert token_range(IndexedDataset(prefix), cache) == (0, 199)
    monkeypatch.setattr(indexed_dataset.IndexedDataset, "token_range", lambda self: pytest.fail("scanned again"))
    assert token_range(IndexedDataset(prefix), cache) == (0, 199)
    _dataset(tmp_path / "ds", high=250)  # rewritten: the cache key (sizes, times) changes
    monkeypatch.undo()
    os.utime(prefix + ".bin", ns=(1, 1))
    assert token_range(IndexedDataset(prefix), cache) == (0, 250)


def test_chunks_cover_the_whole_file(tmp_path):
    prefix = _dataset(tmp_path / "ds", high=7, dtype=np.int32, docs=3)
    ds = IndexedDataset(prefix)
    assert ds.token_range(chunk=7).tolist() == ds.token_range().tolist() == [0, 149]


def test_an_id_past_the_vocabulary_is_an_error_with_tp1(tmp_path, capsys):
    import pretrain_m6

    prefix = _dataset(tmp_path / "ds", high=200)  # vocabulary 200: ids 0..199
    assert pretrain_m6.main(TRAIN + ["--data-path", prefix]) == 2
    err = capsys.readouterr().err
    assert f"error: --data-path {prefix}: token ids run from 0 to 200, but the vocabulary has 200 ids" in err


def test_an_id_past_the_vocabulary_is_an_error_with_tp2(tmp_path):
    prefix = _dataset(tmp_path / "ds", high=220)
    results = launch(TRAIN + ["--data-path", prefix, "--tensor-model-parallel-size", "2"], 2, out_dir=str(tmp_path))
    for rc, out in results:
        assert rc == 2 and "token ids run from 0 to 220, but the vocabulary has 200 ids" in out, out
