"""Weights & Biases with Megatron-LM's flags: an offline run's history equals the JSONL log.

The offline run's ``.wandb`` file is read with wandb's own protobuf schema (``Record``); the file
is a LevelDB-style log (7-byte header, 32 KiB blocks of records framed by crc32, length, type),
which wandb 0.31 no longer reads back in Python. No network: WANDB_MODE=offline."""

import glob
import json
import struct

import pytest

from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from tests.helpers import tiny_config

BLOCK, HEADER = 32768, 7  # LevelDB log framing: block size, record header (crc32 4, length 2, type 1)


def wandb_records(path):
    """The protobuf Records of a .wandb file, reassembled from their block fragments."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + HEADER])
        if kind == 0 and length == 0:
            break
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def item_key(item):
    return item.key or "/".join(item.nested_key)


def history_and_config(save_dir):
    (path,) = glob.glob(f"{save_dir}/wandb/offline-run-*/run-*.wandb")
    rows, config, run = [], {}, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {
                    item_key(item): json.loads(item.value_json)
                    for item in record.history.item
                    if not item_key(item).startswith("_")
                }
            )
        elif kind == "run":
            run = record.run
            config.update({item_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item_key(item): json.loads(item.value_json) for item in record.config.update})
    return rows, config, run


def test_offline_run_history_equals_the_jsonl_log(tmp_path, monkeypatch):
    """Every JSONL record (training and evaluation) is one history row with the same values; the
    config holds the run's config and the planner's summary; the run has Megatron's names."""
    wandb = pytest.importorskip("wandb")
    from megatron_p2r.training import pretrain

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = tmp_path / "m.jsonl"
    cfg = tiny_config(
        train_iters=4,
        log_interval=1,
        log_file=str(log),
        eval_interval=2,
        eval_iters=1,
        global_batch_size=4,
        wandb_project="p2r-test",
        wandb_exp_name="tiny",
        wandb_save_dir=str(tmp_path / "wb"),
    )
    pretrain(cfg)
    wandb.teardown()  # the service writes the run's file out when it stops (at exit in a training process)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    rows, config, run = history_and_config(tmp_path / "wb")
    assert len(records) == 6 and rows == records
    assert (run.project, run.display_name) == ("p2r-test", "tiny")
    assert {key: config[key] for key in cfg.to_dict()} == json.loads(json.dumps(cfg.to_dict()))
    planner = config["planner"]
    assert planner["world_size"] == 1 and planner["memory_per_rank_bytes"]["stage_0"]["host"] > 0


def test_megatrons_rules_are_checked_before_building():
    base = dict(wandb_project="p")
    with pytest.raises(ConfigError, match="--wandb-project needs --wandb-exp-name"):
        validate(tiny_config(**base), 1)
    with pytest.raises(ConfigError, match="needs --wandb-save-dir or --save"):
        validate(tiny_config(**base, wandb_exp_name="e"), 1)


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        ConfigError, match=r"--wandb-project needs the wandb package: pip install megatron_p2r\[wandb\]"
    ):
        validate(tiny_config(wandb_project="p", wandb_exp_name="e", wandb_save_dir=str(tmp_path)), 1)
    monkeypatch.setenv("WANDB_MODE", "disabled")  # wandb's own switch: W&B off, no package needed
    validate(tiny_config(wandb_project="p", wandb_exp_name="e", wandb_save_dir=str(tmp_path)), 1)


def test_no_login_is_one_error_line(tmp_path, monkeypatch):
    """Online mode without an API key: a ConfigError saying what to do (no network is reached)."""
    pytest.importorskip("wandb")
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.wandb_writer import WandbWriter

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # no stored login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = tiny_config(wandb_project="p", wandb_exp_name="e", wandb_save_dir=str(tmp_path / "wb"))
    with pytest.raises(ConfigError, match="--wandb-project p: wandb cannot start the run .*WANDB_MODE=offline"):
        WandbWriter.open(cfg, ParallelPlan.for_world(cfg, 1), "cpu")
