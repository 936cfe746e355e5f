"""Converter output is staged in a directory of the converter's own: published whole, or not at
all; nothing the converter did not create is deleted, and DST is locked while it is written."""
import os

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import LOCK_FILE, DirectoryLock, DirectoryLocked
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
        assert os.listdir(tmp) == [LOCK_FILE]  # the converter's mark, removed when it is done
        assert (dst / "old").read_text() == "old"  # DST is untouched until the result is complete
        open(os.path.join(tmp, "new"), "w").close()
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"] and os.listdir(dst) == ["new"]


def test_the_staging_directory_is_never_a_name_the_user_may_own(tmp_path):
    """The old staging name DST.tmp was removed whatever it held: SRC itself (reshard X.tmp X), or
    an unrelated scratch.tmp next to scratch."""
    src, dst = tmp_path / "x.tmp", tmp_path / "x"
    src.mkdir()
    (src / "keep").write_text("source")
    with staged_output(str(src), str(src), str(dst), force=False) as tmp:
        assert not os.path.realpath(tmp).startswith(os.path.realpath(src))
        open(os.path.join(tmp, "out"), "w").close()
    assert (src / "keep").read_text() == "source" and os.listdir(dst) == ["out"]


@pytest.mark.parametrize("relation", ["same", "src_inside_dst", "dst_inside_src"])
def test_overlapping_src_and_dst_are_refused_even_with_force(tmp_path, relation):
    src = tmp_path / "outer" / "src" if relation == "src_inside_dst" else tmp_path / "src"
    dst = {"same": src, "src_inside_dst": tmp_path / "outer", "dst_inside_src": src / "dst"}[relation]
    src.mkdir(parents=True)
    (src / "keep").write_text("source")
    with pytest.raises(CheckpointError, match="overlaps SRC"):
        with staged_output(str(src), str(src), str(dst), force=True):
            pass
    assert (src / "keep").read_text() == "source" and sorted(os.listdir(src)) == ["keep"]


def test_a_dst_in_use_is_refused(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    with DirectoryLock(str(dst), "training run"):
        with pytest.raises(DirectoryLocked, match="in use by training run"):
            with staged_output(str(src), str(src), str(dst), force=True):
                pass
    assert os.listdir(dst) == []


def test_only_staging_directories_of_killed_conversions_are_cleaned_up(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dead, alive, foreign = (tmp_path / f".dst.p2r-staging-{n}" for n in ("dead", "alive", "foreign"))
    for d in (dead, alive, foreign):
        d.mkdir()
    (dead / LOCK_FILE).write_text('{"host": "%s", "pid": 1}' % os.uname().nodename)  # flock free: its holder died
    (foreign / "data").write_text("not ours: no lock file")
    with DirectoryLock(str(alive), "another conversion"):
        with staged_output(str(src), str(src), str(dst), force=False):
            pass
        assert not dead.exists() and alive.exists() and (foreign / "data").exists()
