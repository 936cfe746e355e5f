"""Save/load on one process: exact restore, load options, and a clear error for each bad input."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.metadata import write_metadata
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.checkpoint.safetensors_io import ShardReader
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import cfg_of
from tests.helpers import run_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD = "iter_0000002/mp_rank_00_000_000.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step checkpoint of the tiny model (with the live state it came from)."""
    root = tmp_path_factory.mktemp("ck") / "run"
    cfg = cfg_of()
    _, state = run_steps(cfg, ParallelState.single(), 2)
    save_checkpoint(str(root), state)
    return root, state


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy to break."""
    dst = tmp_path / "ck"
    shutil.copytree(saved[0], dst)
    return dst


def _fresh(**values):
    return build_train_state(cfg_of(**values), ParallelState.single())


def test_load_restores_everything_exactly(saved):
    root, state = saved
    new = _fresh()
    load_checkpoint(str(root), new)
    for (name, p), (_, q) in zip(state.model.named_parameters(), new.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state.optimizer.state[p][k], new.optimizer.state[q][k]), (name, k)
    assert (new.iteration, new.consumed_samples) == (2, 4)
    assert new.scheduler.state_dict() == state.scheduler.state_dict()
    assert new.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]


def test_finetune_and_no_load_optim(saved):
    root, state = saved
    ft = _fresh()
    load_checkpoint(str(root), ft, finetune=True)
    assert (ft.iteration, ft.consumed_samples, len(ft.optimizer.state)) == (0, 0, 0)
    assert torch.equal(next(ft.model.parameters()), next(state.model.parameters()))
    no_optim = _fresh(no_load_optim=True)
    load_checkpoint(str(root), no_optim)
    assert no_optim.iteration == 2 and len(no_optim.optimizer.state) == 0


def test_keep_last_prunes_old_checkpoints(tmp_path):
    cfg = cfg_of(keep_last=2)
    state = build_train_state(cfg, ParallelState.single())
    for it in (1, 2, 3):
        state.iteration = it
        save_checkpoint(str(tmp_path), state)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"


def _error(path, **values) -> str:
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(str(path), _fresh(**values))
    return str(exc.value)


def test_missing_and_truncated_shards(ckpt):
    shard = ckpt / SHARD
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert f"truncated shard {shard}" in _error(ckpt)
    shard.unlink()
    assert f"missing shard {shard}" in _error(ckpt)


def test_unknown_version_and_missing_fields(ckpt):
    meta_path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    write_metadata(str(meta_path.parent), {**meta, "format_version": 99})
    assert f"{meta_path}: unknown format_version 99" in _error(ckpt)
    del meta["tensors"]
    write_metadata(str(meta_path.parent), meta)
    assert "required field 'tensors' is missing" in _error(ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    assert "names iteration 7, but" in _error(ckpt)
    rng_dir = ckpt / "iter_0000002" / "rng_and_data"
    assert "neither latest_checkpointed_iteration.txt nor metadata.json" in _error(rng_dir)


def test_metadata_and_shard_disagree(ckpt):
    """The shard's header says [32, 96] where metadata.json says [96, 32] (same byte size)."""
    shard = ckpt / SHARD
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode()
    i = header.index('"layers.0.attention.qkv.weight":')
    j = header.index('"shape":[96,32]', i)
    header = header[:j] + '"shape":[32,96]' + header[j + len('"shape":[96,32]') :]
    shard.write_bytes(data[:8] + header.encode() + data[8 + n :])
    msg = _error(ckpt)
    assert str(shard) in msg and "'layers.0.attention.qkv.weight' has shape [32, 96], expected [96, 32]" in msg
    # Bytes appended to a shard: the safetensors library refuses a data region it does not cover.
    shard.write_bytes(data + b"\0" * 8)
    assert "not fully covered" in _error(ckpt)


def test_different_model_shape_names_the_field(ckpt):
    msg = _error(ckpt, hidden_size=64)
    assert "hidden_size = 32, this run has 64 (--hidden-size)" in msg and "metadata.json" in msg
    assert "num_layers = 2, this run has 3 (--num-layers)" in _error(ckpt, num_layers=3)


def test_other_layout_says_how_to_reshard(ckpt, tmp_path):
    other = tmp_path / "tp2"
    convert(str(ckpt), str(other), Target(tensor_parallel_size=2, pipeline_parallel_size=2), progress=False)
    msg = _error(other)
    assert "saved with TP=2, PP=2 (layers per stage [1, 1]), EP=1; this run uses TP=1, PP=1" in msg
    assert (
        f"p2r-convert-checkpoint reshard {other} {other}_tp1_pp1_ep1 --target-tensor-parallel-size 1 "
        "--target-pipeline-parallel-size 1 --target-expert-parallel-size 1"
    ) in msg


def test_pseudo_checkpoint_into_real_run_says_delink(tmp_path):
    cfg = cfg_of(p2r_phase="pseudo", share_pattern="all")
    state = build_train_state(cfg, ParallelState.single())
    save_checkpoint(str(tmp_path / "p"), state)
    msg = _error(tmp_path / "p")
    assert "p2r.phase is 'pseudo'" in msg and f"p2r-convert-checkpoint delink {tmp_path / 'p'}" in msg
    assert "layer->slot maps differ" in _error(tmp_path / "p", p2r_phase="pseudo", share_pattern="cycle:2")


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    import megatron_p2r.training.loop as training
    from megatron_p2r.checkpoint import safetensors_io
    import pretrain_m6

    steps = {"n": 0}
    step = training.train_step
    def train_step(state, mbs):  # the scheduler's SIGTERM arrives during step 2
        out = step(state, mbs)
        steps["n"] += 1
        if steps["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    training.train_step = train_step
    rc = pretrain_m6.main(sys.argv[1:] + ["--exit-signal-handler"])
    print("SIGTERM run returned", rc, flush=True)

    write = safetensors_io.ShardWriter.write
    def dying_write(self, name, tensor):  # SIGKILL in the middle of writing iteration 3
        if "iter_0000003" in self.path and self.next == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, name, tensor)
    safetensors_io.ShardWriter.write = dying_write
    pretrain_m6.main(sys.argv[1:] + ["--load", sys.argv[sys.argv.index("--save") + 1], "--save-interval", "1"])
""")


def test_sigterm_saves_and_a_kill_while_saving_keeps_latest(tmp_path):
    """SIGTERM with --exit-signal-handler saves iteration 2 and returns 0; a run killed while
    writing iteration 3 leaves latest at 2 (and a .tmp directory), and iteration 2 loads."""
    save = tmp_path / "ck"
    argv = [
        "--mock-data",
        "--vocab-size",
        "200",
        "--make-vocab-size-divisible-by",
        "16",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "6",
        "--seed",
        "7",
        "--device",
        "cpu",
        "--save",
        str(save),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "SIGTERM run returned 0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    # the killed run's lock stays (its flock died with it; the next run takes it over)
    assert sorted(os.listdir(save)) == [
        ".p2r_lock",
        "iter_0000002",
        "iter_0000003.tmp",
        "latest_checkpointed_iteration.txt",
    ]
    state = build_train_state(cfg_of(), ParallelState.single())
    assert load_checkpoint(str(save), state).endswith("iter_0000002") and state.iteration == 2
    partial = [f for f in os.listdir(save / "iter_0000003.tmp") if f.endswith(".safetensors")]
    assert partial, "the kill should have happened while the shard was being written"
    with pytest.raises(CheckpointError):
        ShardReader(str(save / "iter_0000003.tmp" / partial[0])).read("final_norm.weight")


def test_exit_interval_on_a_save_interval_saves_once(tmp_path, monkeypatch):
    from megatron_p2r.checkpoint import io
    from megatron_p2r.training import pretrain

    saves = []
    monkeypatch.setattr(io, "save_checkpoint", lambda d, state: saves.append(state.iteration) or d)
    result = pretrain(cfg_of(save=str(tmp_path), save_interval=1, exit_interval=2))
    assert result["exited_early"] and saves == [1, 2]


def test_load_same_as_save_starts_fresh_then_resumes(tmp_path):
    """A job launched with --save D --load D: the first launch finds nothing and starts from
    scratch; the relaunch resumes. A --load elsewhere without a checkpoint stays an error."""
    from megatron_p2r.training import pretrain

    d = str(tmp_path / "ck")
    assert len(pretrain(cfg_of(save=d, load=d, train_iters=1, lr_decay_iters=3))["losses"]) == 1  # warm-up 1 < 3
    assert len(pretrain(cfg_of(save=d, load=d, train_iters=3))["losses"]) == 2
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert "the directory does not exist" in _error(tmp_path / "elsewhere")
