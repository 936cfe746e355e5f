"""A --force conversion killed at any rename of its publish: DST is at every moment the old
checkpoint, the new one, or not loadable with an error that says why, and the next holder of
its lock finishes the move (the new checkpoint) or clears the unfinished output (the old one)."""

import os

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import DirectoryLock
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.checkpoint.publish import finish_interrupted
from megatron_p2r.checkpoint.staging import staged_output

RENAMES = 6  # mark whole, old latest out, old iteration out, mark installing, new iteration in, new latest in


def _checkpoint(root, what: str) -> None:
    """A stand-in checkpoint of iteration 1 whose files say which one it is."""
    os.makedirs(os.path.join(root, "iter_0000001"), exist_ok=True)
    with open(os.path.join(root, "iter_0000001", "metadata.json"), "w") as fh:
        fh.write(what)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")


def _loads(dst) -> str:
    """What --load DST would read: 'old', 'new', or the error it gives."""
    try:
        with open(os.path.join(resolve_iteration_dir(str(dst)), "metadata.json")) as fh:
            return fh.read()
    except CheckpointError as exc:
        return f"error: {exc}"


def _convert_killed_before_rename(src, dst, k: int) -> None:
    """In a child process: the conversion, SIGKILL-like (no clean-up at all) before rename ``k``."""
    pid = os.fork()
    if pid == 0:
        count, real = [0], os.rename

        def rename(a, b, **kw):
            count[0] += 1
            if count[0] == k:
                os._exit(9)
            real(a, b, **kw)

        os.rename = rename
        with staged_output(str(src), str(src), str(dst), force=True) as tmp:
            _checkpoint(tmp, "new")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == (9 if k <= RENAMES else 0)


@pytest.mark.parametrize("k", range(1, RENAMES + 2))
def test_a_publish_killed_before_each_rename_is_finished_by_the_next_holder(tmp_path, k):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _checkpoint(dst, "old")
    _convert_killed_before_rename(src, dst, k)
    state = _loads(dst)
    assert state in ("old", "new") or "killed while moving its result in; rerun that conversion" in state, state
    with DirectoryLock(str(dst), "training run"):
        actions = finish_interrupted(str(dst))
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert _loads(dst) == ("old" if k == 1 else "new")  # the output was whole from the first rename on
    if 1 < k <= RENAMES:
        assert "completed the move" in actions[0]
    elif k == 1:
        assert "the incomplete output" in actions[0]


def test_a_training_run_on_dst_finishes_the_move_too(tmp_path):
    from megatron_p2r.checkpoint.recovery import recover_save_dir

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _checkpoint(dst, "old")
    _convert_killed_before_rename(src, dst, 4)
    actions = recover_save_dir(str(dst))
    assert "completed the move" in actions[0] and _loads(dst) == "new"
