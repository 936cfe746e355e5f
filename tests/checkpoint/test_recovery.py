"""Crash recovery of a save directory: what a kill while saving or pruning leaves, repaired."""

import os

from megatron_p2r.checkpoint.recovery import recover_save_dir


def _iteration(root, name, complete=True):
    d = root / name
    d.mkdir()
    (d / "mp_rank_00_000_000.safetensors").write_bytes(b"x")
    if complete:
        (d / "metadata.json").write_text("{}")


def test_recover_save_dir_repairs_each_leftover(tmp_path):
    _iteration(tmp_path, "iter_0000002")
    _iteration(tmp_path, "iter_0000004.old")  # killed between the two renames of a re-save of 4
    _iteration(tmp_path, "iter_0000002.old")  # killed after the second rename: iter_2 is there
    _iteration(tmp_path, "iter_0000006.tmp", complete=False)
    _iteration(tmp_path, "iter_0000001.del")  # killed while --keep-last deleted it
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    (tmp_path / "latest_checkpointed_iteration.txt.tmp.123").write_text("6")
    actions = recover_save_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert len(actions) == 5 and any("restored" in a and "iter_0000004" in a for a in actions), actions
    assert any("iter_0000006.tmp (left by an interrupted save)" in a for a in actions)
    assert recover_save_dir(str(tmp_path)) == []  # idempotent


def test_missing_latest_is_rewritten_for_the_newest_complete_checkpoint(tmp_path):
    """Killed after the first checkpoint was renamed into place, before latest was written."""
    _iteration(tmp_path, "iter_0000002")
    _iteration(tmp_path, "iter_0000003", complete=False)
    assert "= 2 (the newest complete checkpoint" in recover_save_dir(str(tmp_path))[0]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
