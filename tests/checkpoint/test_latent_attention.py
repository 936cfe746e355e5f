"""A checkpoint of a multi-latent attention model loads only into a run with the same latent
shapes: a mismatch fails before any tensor is read, naming the field and its flag."""

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.helpers import run_steps, tiny_config
from tests.model.test_latent_attention import MLA


def test_latent_shapes_must_match_to_load(tmp_path):
    _, state = run_steps(tiny_config(**MLA), ParallelState.single(), 1)
    save_checkpoint(str(tmp_path / "ckpt"), state)
    load_checkpoint(str(tmp_path / "ckpt"), build_train_state(tiny_config(**MLA), ParallelState.single()))
    for field, value, flag in (("kv_lora_rank", 16, "--kv-lora-rank"), ("q_lora_rank", None, "--q-lora-rank")):
        other = build_train_state(tiny_config(**{**MLA, field: value}), ParallelState.single())
        with pytest.raises(CheckpointError, match=f"the checkpoint's model has {field} = .*\\({flag}\\)"):
            load_checkpoint(str(tmp_path / "ckpt"), other)
