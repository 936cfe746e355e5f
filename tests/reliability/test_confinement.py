"""Every file that names another file -- latest_checkpointed_iteration.txt, metadata.json's files,
the RNG directory, an HF index's weight_map, an HF tokenizer, the dataset index cache -- with a
link out of its directory, a FIFO or a traversal name in place: a clear error (or, for a cache, a
rebuild), never a hang, never a file outside the directory opened or written."""

import contextlib
import json
import os
import shutil
import signal
import sys

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.metadata import write_metadata
from megatron_p2r.convert.reshard import Target
from megatron_p2r.config import ConfigError
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import cfg_of
from tests.reliability.common import tree_digest

IT = "iter_0000000"
SHARD = f"{IT}/mp_rank_00_000_000.safetensors"
RNG = f"{IT}/rng_and_data"


@contextlib.contextmanager
def confined_to(root, seconds=20):
    """Fail on any file opened under ``root``'s parent but outside ``root`` (an audit hook), and on
    a call that blocks (a FIFO) for ``seconds``."""
    outside, parent = [], os.path.dirname(os.path.realpath(root))
    inside = os.path.realpath(root) + os.sep

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) and watching:
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(parent + os.sep) and not path.startswith(inside):
                outside.append(path)

    watching = True
    sys.addaudithook(hook) if not getattr(confined_to, "installed", False) else None
    confined_to.installed, confined_to.hook = True, hook
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"blocked for {seconds} s (a FIFO opened?)"))
    signal.alarm(seconds)
    try:
        yield outside
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        watching = False
    assert not outside, f"opened outside {root}: {outside}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck") / "run"
    save_checkpoint(str(root), build_train_state(cfg_of(), ParallelState.single()))
    return root


def _case(checkpoint, tmp_path):
    """A copy of the checkpoint under tmp_path/case, and a copy of it outside that directory."""
    ck, outside = tmp_path / "case" / "ck", tmp_path / "outside"
    shutil.copytree(checkpoint, ck)
    shutil.copytree(checkpoint, outside)
    return ck, outside


def _load(ck):
    load_checkpoint(str(ck), build_train_state(cfg_of(), ParallelState.single()))


def _link_out(ck, outside, rel):
    target = ck / rel
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.symlink(outside / rel, target)


def _fifo(ck, rel):
    (ck / rel).unlink()
    os.mkfifo(ck / rel)


CHECKPOINT_CASES = {
    "shard linked out": (lambda ck, out: _link_out(ck, out, SHARD), "outside"),
    "rng dir linked out": (lambda ck, out: _link_out(ck, out, RNG), "outside"),
    "iteration dir linked out": (lambda ck, out: _link_out(ck, out, IT), "outside"),
    "shard is a FIFO": (lambda ck, out: _fifo(ck, SHARD), "is a FIFO"),
    "rng file is a FIFO": (lambda ck, out: _fifo(ck, f"{RNG}/rank_00000.safetensors"), "is a FIFO"),
    "metadata.json is a FIFO": (lambda ck, out: _fifo(ck, f"{IT}/metadata.json"), "is a FIFO"),
    "latest is a FIFO": (lambda ck, out: _fifo(ck, "latest_checkpointed_iteration.txt"), "is a FIFO"),
    "files names ../": (
        lambda ck, out: _rename_file_entry(ck, "../../outside/" + SHARD),
        "does not list the config.s layout.s 1 shard files",
    ),
    "files names an absolute path": (
        lambda ck, out: _rename_file_entry(ck, str(out / SHARD)),
        "does not list the config.s layout.s 1 shard files",
    ),
}


def _rename_file_entry(ck, name):
    meta_path = ck / IT / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["files"] = {name: size for size in meta["files"].values()}
    write_metadata(str(meta_path.parent), meta)


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_checkpoint_files_stay_in_their_directory(checkpoint, tmp_path, case):
    plant, message = CHECKPOINT_CASES[case]
    ck, outside = _case(checkpoint, tmp_path)
    plant(ck, outside)
    with confined_to(ck.parent):
        with pytest.raises(CheckpointError, match=message):
            _load(ck)


@pytest.fixture(scope="module")
def hf_dir(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "gpt2"
    export_hf(str(checkpoint), str(out), max_shard_size="20KB", progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def _first_file(src):
    return sorted(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())[0]


def _index_entry(src, name):
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = name
    index.write_text(json.dumps(data))


HF_CASES = {
    "weight_map names ../": lambda src, out: _index_entry(src, "../../outside/" + _first_file(src)),
    "weight_map names an absolute path": lambda src, out: _index_entry(src, str(out / _first_file(src))),
    "weight file linked out": lambda src, out: _link_out(src, out, _first_file(src)),
    "weight file is a FIFO": lambda src, out: _fifo(src, _first_file(src)),
    "config.json is a FIFO": lambda src, out: _fifo(src, "config.json"),
    "index is a FIFO": lambda src, out: _fifo(src, "model.safetensors.index.json"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_files_stay_in_their_directory(hf_dir, tmp_path, case):
    src, outside = tmp_path / "case" / "hf", tmp_path / "outside"
    shutil.copytree(hf_dir, src)
    shutil.copytree(hf_dir, outside)
    HF_CASES[case](src, outside)
    with confined_to(src.parent):
        with pytest.raises((CheckpointError, ConfigError), match="outside|is a FIFO"):
            import_hf(str(src), str(tmp_path / "case" / "dst"), Target(), progress=False)
    assert not (tmp_path / "case" / "dst").exists()


def test_an_hf_tokenizer_file_linked_out_is_not_copied(hf_dir, tmp_path):
    src, secret = tmp_path / "case" / "hf", tmp_path / "secret.json"
    shutil.copytree(hf_dir, src)
    secret.write_text('{"private": 1}')
    os.symlink(secret, src / "vocab.json")
    (src / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ConfigError, match="tokenizer file: 'vocab.json' resolves to .*outside"):
        import_hf(str(src), str(tmp_path / "case" / "dst"), Target(), progress=False)


def test_links_and_fifos_in_the_dataset_index_cache_are_replaced_not_followed(tmp_path):
    from megatron_p2r.data.gpt_dataset import cached_arrays
    import numpy as np

    cache, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    build = lambda: (np.arange(5, dtype=np.int64),)
    cached_arrays(str(cache), "stem", ("a",), {"k": 1}, build)
    names = sorted(os.listdir(cache))
    for name in names:  # every cache file replaced by a link to a file outside (or a FIFO)
        (cache / name).unlink()
        if name.endswith(".npy"):
            os.mkfifo(cache / name)
        else:
            os.symlink(outside / "precious", cache / name)
    before = tree_digest(str(outside))
    with confined_to(cache, seconds=20):
        (out,) = cached_arrays(str(cache), "stem", ("a",), {"k": 1}, build)
    assert out.tolist() == [0, 1, 2, 3, 4] and tree_digest(str(outside)) == before
    assert sorted(os.listdir(cache)) == names and not any(os.path.islink(cache / n) for n in names)
