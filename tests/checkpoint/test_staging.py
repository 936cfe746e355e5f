"""Converter output is staged inside DST, on DST's filesystem, and moved in whole or not at all:
nothing the converter did not create is deleted, DST is locked from the start, a directory a
live run holds is never replaced, and DST itself is never renamed (it may be a mount point)."""

import errno
import os

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import LOCK_FILE, DirectoryLock, DirectoryLocked
from megatron_p2r.checkpoint.staging import staged_output


def _dirs(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    return src, dst


def test_a_failed_conversion_leaves_neither_dst_nor_its_staging_directory(tmp_path):
    src, dst = _dirs(tmp_path)
    with pytest.raises(RuntimeError, match="half way"):
        with staged_output(str(src), str(src), str(dst), force=False) as tmp:
            open(os.path.join(tmp, "part.safetensors"), "w").close()
            raise RuntimeError("half way")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_completed_conversion_replaces_dst_only_with_force(tmp_path):
    src, dst = _dirs(tmp_path)
    dst.mkdir()
    (dst / "old").write_text("old")
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --force"):
        with staged_output(str(src), str(src), str(dst), force=False):
            pass
    with staged_output(str(src), str(src), str(dst), force=True) as tmp:
        assert os.path.dirname(tmp) == str(dst) and os.listdir(tmp) == []  # on DST's filesystem
        assert (dst / "old").read_text() == "old"  # DST is untouched until the result is complete
        open(os.path.join(tmp, "new"), "w").close()
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"] and os.listdir(dst) == ["new"]


def test_dst_is_locked_from_the_start_even_when_it_did_not_exist(tmp_path):
    """A run could start on a DST that did not exist before the converter published it."""
    src, dst = _dirs(tmp_path)
    with staged_output(str(src), str(src), str(dst), force=True) as tmp:
        with pytest.raises(DirectoryLocked, match="in use by conversion"):
            DirectoryLock(str(dst), "training run").acquire()
        open(os.path.join(tmp, "new"), "w").close()
    assert os.listdir(dst) == ["new"]


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
    src, dst = _dirs(tmp_path)
    dst.mkdir()
    with DirectoryLock(str(dst), "training run"):
        with pytest.raises(DirectoryLocked, match="in use by training run"):
            with staged_output(str(src), str(src), str(dst), force=True):
                pass
        assert os.listdir(dst) == [LOCK_FILE]


def test_force_never_replaces_a_directory_a_live_run_writes_into(tmp_path):
    """convert --force into the parent of a live run's --save deleted the run's checkpoints and
    its lock; the run kept saving into a deleted inode."""
    src, dst = _dirs(tmp_path)
    (dst / "run" / "iter_0000005").mkdir(parents=True)
    with DirectoryLock(str(dst / "run"), "training run"):
        with pytest.raises(
            CheckpointError,
            match=rf"{dst / 'run'} is in use by training run .*a --force "
            rf"conversion into {dst} would remove it",
        ):
            with staged_output(str(src), str(src), str(dst), force=True):
                raise AssertionError("nothing may be written")
        assert sorted(os.listdir(dst / "run")) == [LOCK_FILE, "iter_0000005"]
    assert os.listdir(dst) == ["run"]


def test_a_run_started_inside_dst_during_the_conversion_is_not_replaced(tmp_path):
    src, dst = _dirs(tmp_path)
    (dst / "run").mkdir(parents=True)
    run = DirectoryLock(str(dst / "run"), "training run")
    with pytest.raises(CheckpointError, match="in use by training run"):
        with staged_output(str(src), str(src), str(dst), force=True) as tmp:
            open(os.path.join(tmp, "new"), "w").close()
            run.acquire()
    run.release()
    assert os.listdir(dst) == ["run"]  # the output removed, the run's directory kept


def test_a_mount_point_dst_is_filled_without_being_renamed(tmp_path, monkeypatch):
    """rename(2) of a mount point fails with EBUSY: DST itself must never be renamed."""
    src, dst = _dirs(tmp_path)
    dst.mkdir()
    (dst / "old").write_text("old")
    real_rename = os.rename

    def rename(a, b, **kw):
        if str(dst) in (os.path.abspath(a), os.path.abspath(b)):
            raise OSError(errno.EBUSY, "Device or resource busy", str(a))
        return real_rename(a, b, **kw)

    monkeypatch.setattr(os, "rename", rename)
    with staged_output(str(src), str(src), str(dst), force=True) as tmp:
        open(os.path.join(tmp, "new"), "w").close()
    assert os.listdir(dst) == ["new"] and sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_what_a_killed_conversion_left_in_dst_is_removed_and_said(tmp_path, capsys):
    src, dst = _dirs(tmp_path)
    (dst / ".p2r-staging-dead").mkdir(parents=True)
    (dst / ".p2r-staging-dead" / "part").write_text("incomplete")
    with staged_output(str(src), str(src), str(dst), force=False) as tmp:
        open(os.path.join(tmp, "new"), "w").close()
    assert os.listdir(dst) == ["new"]
    assert "the incomplete output of a conversion" in capsys.readouterr().out


def test_leftovers_beside_dst_of_earlier_versions_are_restored_or_reported_never_removed(tmp_path, capsys):
    """Earlier versions replaced DST by two renames; a kill between them left DST missing and the
    old one hidden in .DST.p2r-replaced-*/old, and the next run deleted the complete staging
    directory."""
    src, dst = _dirs(tmp_path)
    (tmp_path / ".dst.p2r-replaced-ab" / "old").mkdir(parents=True)
    (tmp_path / ".dst.p2r-replaced-ab" / "old" / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / ".dst.p2r-staging-cd").mkdir()
    (tmp_path / ".dst.p2r-staging-cd" / "complete").write_text("new")
    with pytest.raises(CheckpointError, match="not empty; pass --force"):
        with staged_output(str(src), str(src), str(dst), force=False):
            pass
    out = capsys.readouterr().out
    assert f"restored {dst}" in out and "possibly complete" in out
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (tmp_path / ".dst.p2r-staging-cd" / "complete").read_text() == "new"
    assert not (tmp_path / ".dst.p2r-replaced-ab").exists()
