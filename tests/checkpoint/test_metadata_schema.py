"""metadata.json's schema covers what later features added: the LR scheduler's state in samples
(num_steps, updates, re-warm-up) and the head-block layout of attention projections (rows)."""

import json

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.metadata import build_metadata, read_metadata
from megatron_p2r.checkpoint.tensor_table import tensor_table
from megatron_p2r.optim.grad_scaler import LossScaler
from tests.helpers import tiny_config

SCHEDULER = {"num_steps": 16, "updates": 2, "rewarmup": {"start": 2, "iters": 4}}


def _write(tmp_path, **changes):
    cfg = tiny_config(group_query_attention=True, num_query_groups=2)
    meta = build_metadata(
        cfg,
        tensor_table(cfg),
        iteration=2,
        consumed_samples=16,
        optimizer=False,
        scheduler=SCHEDULER,
        scaler=LossScaler(cfg.train).state_dict(),
        files={},
        rng=None,
        history=[],
        checksums={},
    )
    rows = next(key for key, entry in meta["tensors"].items() if "rows" in entry)
    for field, value in changes.items():
        if field == "rows":
            meta["tensors"][rows]["rows"] = value
        else:
            meta[field] = value
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    return read_metadata(str(tmp_path))


def test_a_checkpoint_of_this_code_reads(tmp_path):
    assert _write(tmp_path)["scheduler"] == SCHEDULER
    assert _write(tmp_path, scheduler={"num_steps": 0})["scheduler"] == {"num_steps": 0}  # an imported one


@pytest.mark.parametrize(
    "scheduler",
    [
        {"step_count": 3},
        {"num_steps": -1},
        {"num_steps": 1, "updates": "2"},
        {"num_steps": 1, "rewarmup": {"start": 0, "iters": 0}},
        {"num_steps": 1, "rewarmup": [0, 2]},
    ],
)
def test_a_bad_scheduler_state_names_the_field(tmp_path, scheduler):
    with pytest.raises(CheckpointError, match="field 'scheduler' must be an object with an integer num_steps"):
        _write(tmp_path, scheduler=scheduler)


@pytest.mark.parametrize(
    "rows",
    [
        {"groups": 0, "per_group": ["k", "v"], "head_dim": 8},
        {"groups": 2, "per_group": "kv", "head_dim": 8},
        {"groups": 2},
        "x",
    ],
)
def test_bad_attention_rows_name_the_tensor(tmp_path, rows):
    with pytest.raises(CheckpointError, match=r"tensors\['.*'\] has no valid 'rows'"):
        _write(tmp_path, rows=rows)
