"""Every tensor's CRC-32 is recorded in metadata.json at save and by the converters, and checked
on every read: a flipped bit in a shard's data region is an error naming the file and the
tensor, in a load, a conversion and ``inspect --verify``; metadata.json carries the CRC-32 of its
own bytes, so an edit of it is refused too; checkpoints without checksums load, saying so."""

import json
import os
import re
import shutil
import struct

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.metadata import SELF_CHECKSUM, write_metadata
from megatron_p2r.checkpoint.safetensors_io import ShardReader
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import cfg_of, metadata
from tests.helpers import run_steps
from tools.convert_checkpoint import main

SHARD = "mp_rank_00_000_000.safetensors"
RNG = "rng_and_data/rank_00000.safetensors"
TENSOR = "layers.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("crc") / "run"
    _, state = run_steps(cfg_of(), ParallelState.single(), 2)
    save_checkpoint(str(root), state)
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def _flip_a_bit(ckpt, entry: str = TENSOR, name: str = SHARD) -> None:
    path = ckpt / "iter_0000002" / name
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        start, end = json.loads(fh.read(n))[entry]["data_offsets"]
    with open(path, "r+b") as fh:
        fh.seek(8 + n + (start + end) // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0x10]))


def test_every_tensor_of_every_shard_has_its_checksum(saved):
    iter_dir = saved / "iter_0000002"
    crc = metadata(str(iter_dir))["crc32"]
    assert set(crc) == {SHARD, RNG}
    for name in crc:
        assert set(crc[name]) == set(ShardReader(str(iter_dir / name)).names())
    assert sorted(os.listdir(iter_dir)) == ["metadata.json", SHARD, "rng_and_data"]  # nothing else left beside
    assert os.listdir(iter_dir / "rng_and_data") == ["rank_00000.safetensors"]


def test_a_flipped_bit_fails_the_load_naming_file_and_tensor(ckpt):
    _flip_a_bit(ckpt)
    with pytest.raises(
        CheckpointError,
        match=rf"corrupt shard .*{SHARD}: tensor '{TENSOR}' has CRC-32 [0-9a-f]{{8}}, "
        "metadata.json records",
    ):
        load_checkpoint(str(ckpt), build_train_state(cfg_of(), ParallelState.single()))


def test_a_flipped_bit_in_an_rng_file_fails_the_load_unless_rng_is_not_loaded(ckpt):
    _flip_a_bit(ckpt, "cpu_rng_state", RNG)
    with pytest.raises(CheckpointError, match=rf"corrupt shard .*{RNG}: tensor 'cpu_rng_state' has CRC-32"):
        load_checkpoint(str(ckpt), build_train_state(cfg_of(), ParallelState.single()))
    load_checkpoint(str(ckpt), build_train_state(cfg_of(no_load_rng=True), ParallelState.single()))


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{ck}", "--verify"],
        ["reshard", "{ck}", "{out}", "--no-progress", "--target-tensor-parallel-size", "2"],
    ],
)
def test_a_flipped_bit_is_found_by_inspect_verify_and_the_converter(ckpt, tmp_path, capsys, argv):
    _flip_a_bit(ckpt, "optimizer.exp_avg_sq.layers.1.attention.proj.weight")
    assert main(["inspect", str(ckpt)]) == 0  # headers only: the data is not read
    capsys.readouterr()
    assert main([a.format(ck=ckpt, out=tmp_path / "out") for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: corrupt shard") and "'optimizer.exp_avg_sq.layers.1.attention.proj.weight'" in err
    assert not (tmp_path / "out").exists()


def test_converters_record_checksums_that_verify(saved, tmp_path, capsys):
    out, same = tmp_path / "out", tmp_path / "same"
    assert main(["reshard", str(saved), str(out), "--target-tensor-parallel-size", "2", "--no-progress"]) == 0
    assert set(metadata(str(out / "iter_0000002"))["crc32"]) == {
        "mp_rank_00_000_000.safetensors",
        "mp_rank_01_000_000.safetensors",
    }
    assert main(["reshard", str(saved), str(same), "--no-progress"]) == 0  # the RNG files are copied, and theirs
    assert set(metadata(str(same / "iter_0000002"))["crc32"]) == {SHARD, RNG}
    for converted in (out, same):
        assert main(["inspect", str(converted), "--verify"]) == 0
        assert "every CRC-32 matches metadata.json" in capsys.readouterr().out


def test_a_checkpoint_without_checksums_still_loads(ckpt, capsys):
    path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(path.read_text())
    del meta["crc32"], meta[SELF_CHECKSUM]  # as written before either was
    path.write_text(json.dumps(meta))
    load_checkpoint(str(ckpt), build_train_state(cfg_of(), ParallelState.single()))
    assert "no checksums recorded (a checkpoint written before they were)" in capsys.readouterr().out
    assert main(["inspect", str(ckpt), "--verify"]) == 0
    assert "no checksums recorded" in capsys.readouterr().out


def _edit_text(ckpt, old: str, new: str) -> None:
    """Edit metadata.json's text as a user would (the rest of the file byte-identical)."""
    path = ckpt / "iter_0000002" / "metadata.json"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(
    "old, new",
    [
        ('"consumed_samples": 4', '"consumed_samples": 5'),
        ('"iteration": 2', '"iteration": 2 '),
        ('"crc32": {', '"crc32": null, "x": {'),
    ],
)
def test_an_edited_metadata_json_is_refused_by_load_and_inspect(ckpt, capsys, old, new):
    """metadata.json's own bytes are checksummed: a shifted data position, a whitespace edit, or
    its tensor checksums removed (then a flipped bit in a shard would load) are refused."""
    _edit_text(ckpt, old, new)
    _flip_a_bit(ckpt)
    message = r"metadata.json: corrupt or edited: its bytes have CRC-32 [0-9a-f]{8}, its field 'metadata_crc32' records"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(ckpt), build_train_state(cfg_of(), ParallelState.single()))
    assert main(["inspect", str(ckpt), "--verify"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_checkpoint_with_both_checksums_says_so_and_one_saved_in_parts_cannot_lack_them(ckpt, capsys):
    assert main(["inspect", str(ckpt), "--verify"]) == 0
    assert "every CRC-32 matches metadata.json, whose own bytes match its metadata_crc32" in capsys.readouterr().out
    path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(path.read_text())
    del meta["crc32"], meta[SELF_CHECKSUM]
    meta["parts"] = {SHARD: [SHARD + ".part0"]}
    path.write_text(json.dumps(meta))
    assert main(["inspect", str(ckpt), "--verify"]) == 2
    assert "field 'crc32' is missing, but a checkpoint saved in parts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda crc: crc[SHARD].pop(TENSOR), f"crc32\\['{SHARD}'\\] has no value for tensor '{TENSOR}'"),
        (lambda crc: crc[SHARD].update(extra=1), f"crc32\\['{SHARD}'\\] lists tensor 'extra'"),
        (lambda crc: crc[SHARD].update({TENSOR: -1}), "field 'crc32' must be an object of file names"),
    ],
)
def test_a_checksum_table_that_does_not_cover_the_files_is_refused(ckpt, capsys, edit, message):
    path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta["crc32"])
    write_metadata(str(path.parent), meta)
    assert main(["inspect", str(ckpt)]) == 2
    assert re.search(message, capsys.readouterr().err)
