"""Converter output is staged in DST.tmp: published whole, or not at all."""
import os

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.staging import staged_output


def test_a_failed_conversion_leaves_neither_dst_nor_its_staging_directory(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    with pytest.raises(RuntimeError, match="half way"):
        with staged_output(str(src), str(src), str(dst), force=False) as tmp:
            open(os.path.join(tmp, "part.safetensors"), "w").close()
            raise RuntimeError("half way")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_completed_conversion_replaces_dst_only_with_force(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (dst / "old").write_text("old")
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --force"):
        with staged_output(str(src), str(src), str(dst), force=False):
            pass
    with staged_output(str(src), str(src), str(dst), force=True) as tmp:
        assert os.listdir(tmp) == []
        assert (dst / "old").read_text() == "old"  # DST is untouched until the result is complete
        open(os.path.join(tmp, "new"), "w").close()
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"] and os.listdir(dst) == ["new"]
