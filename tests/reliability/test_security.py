"""No file this project reads can run code; its writers never write through a planted link."""

import os
import pickle
import re

import numpy as np
import pytest

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.data.indexed_dataset import IndexedDataset
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import cfg_of
from tests.reliability.common import ROOT, tree_digest
from tools import preprocess_data


class _Payload:
    """Unpickling this creates ``path``: the proof that a loader executed code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck") / "run"
    save_checkpoint(str(root), build_train_state(cfg_of(), ParallelState.single()))
    return root


@pytest.mark.parametrize(
    "victim", ["iter_0000000/mp_rank_00_000_000.safetensors", "iter_0000000/rng_and_data/rank_00000.safetensors"]
)
def test_a_pickle_in_a_checkpoint_is_refused_not_executed(checkpoint, tmp_path, victim):
    import shutil

    ck, marker = tmp_path / "ck", tmp_path / "pwned"
    shutil.copytree(checkpoint, ck)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        (ck / victim).write_bytes(pickle.dumps(_Payload(str(marker)), protocol=protocol))
        with pytest.raises(CheckpointError, match="shard"):
            load_checkpoint(str(ck), build_train_state(cfg_of(), ParallelState.single()))
        assert not marker.exists()


def test_a_pickled_index_cache_is_not_executed(tmp_path):
    """The GPT dataset's .npy index caches are loaded with allow_pickle=False: a cache replaced by
    an object array holding the payload is rebuilt with a warning, never run."""
    from megatron_p2r.data.gpt_dataset import cached_arrays

    marker = tmp_path / "pwned"
    build = lambda: (np.arange(5, dtype=np.int64),)
    cached_arrays(str(tmp_path), "stem", ("a",), {"k": 1}, build)
    (cache,) = [p for p in tmp_path.iterdir() if p.suffix == ".npy"]
    evil = np.empty(1, dtype=object)
    evil[0] = _Payload(str(marker))
    with open(cache, "wb") as fh:
        np.save(fh, evil, allow_pickle=True)
    with pytest.warns(UserWarning, match="unreadable"):
        (out,) = cached_arrays(str(tmp_path), "stem", ("a",), {"k": 1}, build)
    assert out.tolist() == [0, 1, 2, 3, 4] and not marker.exists()
    (again,) = cached_arrays(str(tmp_path), "stem", ("a",), {"k": 1}, build)  # the rebuilt cache loads
    assert again.tolist() == [0, 1, 2, 3, 4]


def test_no_code_path_unpickles():
    """Static guard: no pickle/torch.load without weights_only/np.load with allow_pickle=True."""
    pattern = re.compile(
        r"pickle\.loads?\(|torch\.load\((?![^)]*weights_only=True)|allow_pickle=True|"
        r"dill|cloudpickle|yaml\.load\((?![^)]*SafeLoader)|yaml\.unsafe_load"
    )
    hits = []
    for top in ("megatron_p2r", "tools", "pretrain_m6.py"):
        base = os.path.join(ROOT, top)
        files = (
            [base]
            if base.endswith(".py")
            else [os.path.join(r, f) for r, _, fs in os.walk(base) for f in fs if f.endswith(".py")]
        )
        for path in files:
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                if pattern.search(line) and not line.lstrip().startswith("#"):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not hits, hits


def _outside(tmp_path):
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    target.write_text("keep me")
    return target


def test_preprocess_never_writes_through_a_planted_link(tmp_path, capsys):
    """Links planted at the temporary names (predictable: pid) and at a final output name."""
    target = _outside(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "hello"}\n')
    prefix = out / "corpus"
    pid = os.getpid()
    for name in (f"corpus_text_document.bin.tmp{pid}", f"corpus_text_document.idx.tmp{pid}"):
        os.symlink(target, out / name)
    os.symlink(tmp_path / "outside" / "dangling", out / "corpus_text_document.idx")
    argv = ["--input", str(inp), "--output-prefix", str(prefix), "--tokenizer-type", "ByteTokenizer"]
    assert preprocess_data.main(argv) == 2  # a dangling link is an output
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert preprocess_data.main(argv + ["--overwrite"]) == 0
    assert target.read_text() == "keep me" and not (tmp_path / "outside" / "dangling").exists()
    assert not (out / "corpus_text_document.idx").is_symlink()
    assert len(IndexedDataset(str(out / "corpus_text_document"))) == 1
    assert sorted(os.listdir(out)) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_converter_and_checkpoint_writes_never_follow_a_planted_link(checkpoint, tmp_path):
    target = _outside(tmp_path)
    outside_dir = target.parent
    before = tree_digest(str(outside_dir))
    dst = tmp_path / "dst"
    os.symlink(outside_dir, tmp_path / "dst.tmp")  # the old staging name: neither used nor removed
    convert(str(checkpoint), str(dst), Target(tensor_parallel_size=2), progress=False)
    assert os.path.islink(tmp_path / "dst.tmp") and (dst / "latest_checkpointed_iteration.txt").is_file()
    link = tmp_path / "link"
    os.symlink(outside_dir, link)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        convert(str(checkpoint), str(link), Target(tensor_parallel_size=2), progress=False, force=True)
    latest = tmp_path / "latest.txt"
    os.symlink(target, f"{latest}.tmp.{os.getpid()}")
    write_text_atomic(str(latest), "3")
    assert latest.read_text() == "3"
    assert tree_digest(str(outside_dir)) == before and target.read_text() == "keep me"
