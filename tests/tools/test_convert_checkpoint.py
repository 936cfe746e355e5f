"""The p2r-convert-checkpoint command line: inspect, reshard, delink, and its error exits."""

import os

import pytest

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.parallel.state import ParallelState
from tests.checkpoint.common import metadata
from tests.helpers import run_steps, tiny_config
from tools.convert_checkpoint import main


@pytest.fixture(scope="module")
def pseudo(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "pseudo"
    cfg = tiny_config(num_layers=4, p2r_phase="pseudo", share_pattern="all")
    _, state = run_steps(cfg, ParallelState.single(), 1)
    save_checkpoint(str(root), state)
    return root


def test_inspect_prints_metadata_tensors_and_files(pseudo, capsys):
    assert main(["inspect", str(pseudo)]) == 0
    out = capsys.readouterr().out
    assert "iteration    1   consumed samples 2" in out
    assert "phase        pseudo   share pattern all   layer -> module [0, 0, 0, 0]" in out
    assert "layout       TP=1 PP=1 EP=1   layers per stage [4]" in out
    row = next(line for line in out.splitlines() if line.startswith("layers.0.mlp.fc1.weight"))
    assert row.split() == ["layers.0.mlp.fc1.weight", "128x32", "0", "-", "0", "0,1,2,3", "16.0", "KiB"]
    assert "mp_rank_00_000_000.safetensors" in out and "total" in out


def test_delink_and_reshard_commands(pseudo, tmp_path, capsys):
    real = tmp_path / "real"
    assert (
        main(
            [
                "delink",
                str(pseudo),
                str(real),
                "--optimizer-state",
                "rescale",
                "--target-tensor-parallel-size",
                "2",
                "--target-pipeline-parallel-size",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert f"load it with --load {real}" in capsys.readouterr().out
    meta = metadata(str(real / "iter_0000001"))
    assert meta["p2r"]["layer_module_keys"] == [0, 1, 2, 3] and meta["layout"]["tp"] == 2
    assert meta["history"][-1]["optimizer_state"] == "rescale"
    assert (
        main(["reshard", str(real), str(tmp_path / "split"), "--target-pipeline-layer-split", "3,1", "--no-progress"])
        == 0
    )
    assert metadata(str(tmp_path / "split" / "iter_0000001"))["layout"]["stage_layers"] == [[0, 3], [3, 4]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["reshard", "{src}", "{dst}", "--target-tensor-parallel-size", "3"],
            "--target-tensor-parallel-size 3 does not divide the model's --num-attention-heads (4)",
        ),
        (
            ["reshard", "{src}", "{dst}", "--target-pipeline-layer-split", "1,1"],
            "--target-pipeline-layer-split '1,1' adds up to 2, but --num-layers is 4",
        ),
        (
            ["reshard", "{src}", "{dst}", "--target-expert-parallel-size", "2"],
            "--target-expert-parallel-size 2 needs an MoE model",
        ),
        (["reshard", "{missing}", "{dst}"], "the directory does not exist"),
        (["delink", "{src}", "{src}"], "overlaps SRC"),
    ],
)
def test_errors_exit_2_with_a_message(pseudo, tmp_path, capsys, argv, message):
    argv = [a.format(src=pseudo, dst=tmp_path / "out", missing=tmp_path / "none") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("relation", ["src is dst.tmp", "src inside dst", "dst inside src", "same"])
def test_the_converter_never_touches_its_source(pseudo, tmp_path, capsys, relation):
    """``reshard X.tmp X`` used to delete its own source (the staging directory was DST.tmp), and
    --force on a DST holding SRC would have deleted it."""
    import shutil
    from tests.reliability.common import tree_digest

    src = {
        "src is dst.tmp": tmp_path / "x.tmp",
        "src inside dst": tmp_path / "outer" / "src",
        "dst inside src": tmp_path / "src",
        "same": tmp_path / "src",
    }[relation]
    dst = {
        "src is dst.tmp": tmp_path / "x",
        "src inside dst": tmp_path / "outer",
        "dst inside src": src / "dst",
        "same": src,
    }[relation]
    shutil.copytree(pseudo, src)
    before = tree_digest(str(src))
    rc = main(["reshard", str(src), str(dst), "--target-tensor-parallel-size", "2", "--no-progress", "--force"])
    assert tree_digest(str(src)) == before
    if relation == "src is dst.tmp":
        assert rc == 0 and (dst / "latest_checkpointed_iteration.txt").is_file()
    else:
        assert rc == 2 and "overlaps SRC" in capsys.readouterr().err


def test_force_into_the_parent_of_a_live_runs_save_is_refused(pseudo, tmp_path, capsys):
    """convert --force into the parent of a live run's --save deleted the run's checkpoints and
    its lock, and the run kept saving into a deleted directory."""
    import shutil
    from megatron_p2r.checkpoint.lock import DirectoryLock
    from tests.reliability.common import tree_digest

    parent = tmp_path / "p"
    shutil.copytree(pseudo, parent / "run")
    with DirectoryLock(str(parent / "run"), "training run"):  # the live run's lock on its --save
        before = tree_digest(str(parent))
        assert main(["reshard", str(pseudo), str(parent), "--force", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {parent / 'run'} is in use by training run (pid ") and len(err.splitlines()) == 1
        assert tree_digest(str(parent)) == before


def test_a_run_cannot_start_on_a_dst_being_converted_into(pseudo, tmp_path, monkeypatch):
    """DST did not exist before the conversion, so it had no lock until the converter published
    it: a run could start on it and then be replaced by --force."""
    from megatron_p2r.convert import reshard
    from megatron_p2r.checkpoint.errors import CheckpointError
    from megatron_p2r.lifecycle import lock_save_dir

    dst, refused = tmp_path / "new", []
    verify = reshard.verify

    def start_a_run_meanwhile(*args, **kwargs):
        cfg = tiny_config(num_layers=4, save=str(dst))
        with pytest.raises(CheckpointError, match=f"{dst} is in use by conversion"):
            lock_save_dir(cfg, ParallelState.single())
        refused.append(True)
        return verify(*args, **kwargs)

    monkeypatch.setattr(reshard, "verify", start_a_run_meanwhile)
    assert main(["reshard", str(pseudo), str(dst), "--no-progress"]) == 0
    assert refused and (dst / "latest_checkpointed_iteration.txt").is_file()


@pytest.mark.parametrize("when", ["checking headers", "copying tensors"])
def test_a_source_pruned_underneath_the_converter_is_said_so(pseudo, tmp_path, capsys, monkeypatch, when):
    """A run's --keep-last prunes SRC while it is converted: the input was good, so exit 1 with the
    file that disappeared (it said 'corrupt shard' and exit 2)."""
    import shutil
    from megatron_p2r.checkpoint import safetensors_io

    src = tmp_path / "src"
    shutil.copytree(pseudo, src)
    target = (safetensors_io.ShardReader, "__init__" if when == "checking headers" else "read")
    inner = getattr(*target)

    def pruning(*args, **kwargs):
        if (src / "iter_0000001").exists():  # the way io._prune deletes a checkpoint
            os.rename(src / "iter_0000001", src / "iter_0000001.del")
            shutil.rmtree(src / "iter_0000001.del")
        return inner(*args, **kwargs)

    monkeypatch.setattr(*target, pruning)
    assert (
        main(["reshard", str(src), str(tmp_path / "out"), "--target-tensor-parallel-size", "2", "--no-progress"]) == 1
    )
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"error: {src / 'iter_0000001'}/mp_rank_00_000_000.safetensors disappeared while it was being read"
        )
        and len(err.splitlines()) == 1
    )
    assert not (tmp_path / "out").exists()
