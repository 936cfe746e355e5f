"""The streaming safetensors writer and reader of the shard files."""

import struct

import pytest
import torch
from safetensors import safe_open

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.safetensors_io import ShardReader, ShardWriter

TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.arange(7, dtype=torch.int64),
    "c": torch.tensor(2.5),
    "d": torch.randn(4, 2).to(torch.bfloat16),
    "e": torch.randint(0, 255, (9,), dtype=torch.uint8),
}


def _write(path, tensors=TENSORS):
    w = ShardWriter(
        str(path),
        [
            (
                k,
                {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16", torch.uint8: "U8"}[v.dtype],
                tuple(v.shape),
            )
            for k, v in tensors.items()
        ],
        {"tp": 0},
    )
    for k, v in tensors.items():
        w.write(k, v)
    w.close()


def test_shard_round_trip_and_safetensors_compatible(tmp_path):
    path = tmp_path / "x.safetensors"
    _write(path)
    reader = ShardReader(str(path))
    for k, v in TENSORS.items():
        assert torch.equal(reader.read(k), v), k
    assert reader.metadata == {"tp": "0"}
    with safe_open(str(path), framework="pt") as f:  # the official reader accepts the file
        assert set(f.keys()) == set(TENSORS) and f.metadata() == {"tp": "0"}
        for k, v in TENSORS.items():
            assert torch.equal(f.get_tensor(k), v), k


def test_writer_enforces_announced_order_shape_and_completeness(tmp_path):
    w = ShardWriter(str(tmp_path / "y"), [("a", "F32", (2,)), ("b", "F32", (3,))])
    with pytest.raises(CheckpointError, match="expected tensor 'a' F32\\[2\\] next, got 'b'"):
        w.write("b", torch.zeros(3))
    with pytest.raises(CheckpointError, match="expected tensor 'a' F32\\[2\\] next, got 'a' F32\\[3\\]"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="1 announced tensors were never written, first 'b'"):
        w.close()


@pytest.mark.parametrize("keep", [0, 5, 12, 40, -1])
def test_reader_detects_truncation(tmp_path, keep):
    path = tmp_path / "x.safetensors"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CheckpointError, match=f"truncated shard {path}"):
        ShardReader(str(path))


def test_reader_names_missing_and_corrupt_files(tmp_path):
    with pytest.raises(CheckpointError, match="missing shard .*nope.safetensors"):
        ShardReader(str(tmp_path / "nope.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        ShardReader(str(bad))
