"""Every configuration rule fails at start with its own message; YAML and flags agree."""

import dataclasses
import json
import math

import pytest

import pretrain_m6
from megatron_p2r.arguments import config_from_values, load_yaml, parse_args, to_argv
from megatron_p2r.config import ConfigError, data_parallel_size, num_microbatches, validate
from megatron_p2r.data.tokenizers import ByteTokenizer
from megatron_p2r.training import resolve_vocab

BASE = dict(mock_data=True, vocab_size=100, num_layers=4, hidden_size=64, num_attention_heads=8)

CASES = [
    (dict(num_attention_heads=6), 1, "--hidden-size (64) must be divisible by --num-attention-heads (6)"),
    (
        dict(tensor_model_parallel_size=3),
        3,
        "--num-attention-heads (8) must be divisible by --tensor-model-parallel-size (3)",
    ),
    (
        dict(tensor_model_parallel_size=2),
        3,
        "world size 3 must be divisible by --tensor-model-parallel-size (2) x --pipeline-model-parallel-size (1)",
    ),
    (
        dict(global_batch_size=6, micro_batch_size=4),
        1,
        "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel size (1)",
    ),
    (dict(pipeline_model_parallel_size=8), 8, "--pipeline-model-parallel-size (8) exceeds --num-layers (4)"),
    (
        dict(num_experts=6, expert_model_parallel_size=3),
        4,
        "--expert-model-parallel-size (3) must divide the data-parallel size",
    ),
    (
        dict(num_experts=6, expert_model_parallel_size=4),
        4,
        "--num-experts (6) must be divisible by --expert-model-parallel-size (4)",
    ),
    (dict(expert_model_parallel_size=2), 2, "--expert-model-parallel-size > 1 needs --num-experts"),
    (dict(bf16=True, fp16=True), 1, "--bf16 and --fp16 are mutually exclusive"),
    (dict(mock_data=False), 1, "no training data"),
    (dict(vocab_size=None), 1, "--mock-data needs --vocab-size"),
    (dict(save_interval=5), 1, "--save-interval needs --save DIR"),
    (dict(share_pattern="block:3", p2r_phase="pseudo"), 1, "K (3) must divide --num-layers (4)"),
    (dict(pipeline_model_parallel_size=2, pipeline_layer_split="1,2"), 2, "adds up to 3, but --num-layers is 4"),
    (dict(pipeline_model_parallel_size=2, pipeline_layer_split="4,0"), 2, "every stage needs at least one layer"),
    (
        dict(tensor_model_parallel_size=2, make_vocab_size_divisible_by=3, num_attention_heads=8),
        2,
        "--make-vocab-size-divisible-by (3) must be divisible by --tensor-model-parallel-size (2)",
    ),
    (dict(num_experts=8, moe_num_prototypes=3), 1, "--num-experts (8) must be divisible by --moe-num-prototypes (3)"),
    (
        dict(overlap_param_gather=True, use_distributed_optimizer=True),
        1,
        "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce",
    ),
    # checked with --mock-data too (BASE), which never splits anything
    (dict(split="80,20,x"), 1, "--split must be comma-separated numbers like 969,30,1, got '80,20,x'"),
    (dict(split="1,nan"), 1, "--split takes up to 3 finite non-negative numbers"),
]


@pytest.mark.parametrize("overrides,world,message", CASES)
def test_each_rule_has_its_message(overrides, world, message):
    cfg = config_from_values({**BASE, **overrides})
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    assert message in str(err.value)


def test_valid_config_passes():
    cfg = config_from_values(
        dict(
            BASE,
            tensor_model_parallel_size=2,
            num_experts=4,
            expert_model_parallel_size=2,
            global_batch_size=8,
            micro_batch_size=2,
        )
    )
    validate(cfg, 8)
    assert (data_parallel_size(cfg, 8), num_microbatches(cfg, 8)) == (4, 1)


def test_yaml_keys_are_flag_names_and_cli_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num-layers: 6\nhidden_size: 128\nbf16: true\ndata-path: [0.3, A, 0.7, B]\n")
    cfg = parse_args(["--config", str(path), "--num-layers", "8"])
    assert cfg.model.num_layers == 8 and cfg.model.hidden_size == 128 and cfg.train.bf16
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"]
    assert parse_args(to_argv(cfg)).to_dict() == cfg.to_dict()  # flags round-trip


def test_yaml_unknown_key_suggests_the_right_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num-layer: 6\n")
    with pytest.raises(ConfigError, match="unknown key 'num-layer'; did you mean 'num-layers'"):
        load_yaml(str(path))
    path.write_text("num-layers: six\n")
    with pytest.raises(ConfigError, match="key 'num-layers' expects int"):
        load_yaml(str(path))
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_yaml(str(path))


@pytest.mark.parametrize(
    "text, what",
    [
        ("split: !!set {969: null}", r"got \{969\} \(a !!set\)"),
        ("tokenizer-model: !!binary aGVsbG8=", r"got b'hello' \(!!binary\); quote it to give text"),
        ("data-cache-path: 2024-01-02", r"got datetime.date\(2024, 1, 2\) \(a date\); quote it"),
        ("data-cache-path: 2024-01-02 10:00:00", r"got datetime.datetime\(.*\) \(a timestamp\); quote it"),
        ("split: yes", r"got True \(a boolean\); quote it"),
        ("share-pattern: {all: 1}", r"got \{'all': 1\} \(a mapping\)"),
        ("data-path: [A, [B]]", r"got \['B'\] \(a list\)"),
    ],
)
def test_yaml_value_of_another_type_for_a_text_flag_is_refused(tmp_path, text, what):
    """str() of a set, bytes or a date would become a split, a path or a pattern nobody wrote."""
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    key = text.split(":")[0]
    with pytest.raises(ConfigError, match=rf"key '{key}' expects str, {what}"):
        load_yaml(str(path))


def test_yaml_numbers_are_text_where_text_is_expected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("split: 100\ndata-path: [0.5, A, 1, B]\n")
    values = load_yaml(str(path))
    assert values["split"] == "100" and values["data_path"] == ["0.5", "A", "1", "B"]


def test_several_config_files_merge_in_order(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("num-layers: 6\nhidden-size: 128\n")
    b.write_text("num-layers: 8\n")
    cfg = parse_args(["--config", str(a), str(b)])
    assert cfg.model.num_layers == 8 and cfg.model.hidden_size == 128


def test_expert_prototypes_must_be_at_least_one():
    with pytest.raises(ConfigError, match="--moe-num-prototypes must be >= 1, got 0"):
        validate(config_from_values(dict(BASE, num_experts=4, moe_num_prototypes=0)), 1)


def test_config_is_frozen_and_replace_returns_a_new_one():
    cfg = config_from_values(BASE)
    for section in (
        cfg.model,
        cfg.parallel,
        cfg.train,
        cfg.p2r,
        cfg.data,
        cfg.checkpoint,
        cfg.logging,
        cfg.offload,
        cfg.profiling,
    ):
        name = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, getattr(section, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model
    new = cfg.replace(num_layers=8, pipeline_model_parallel_size=2, p2r_phase="pseudo")
    assert (new.model.num_layers, new.parallel.pipeline_model_parallel_size, new.p2r.p2r_phase) == (8, 2, "pseudo")
    assert (cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size, cfg.p2r.p2r_phase) == (4, 1, "real")
    assert new.model.hidden_size == 64 and new.train == cfg.train
    with pytest.raises(ConfigError, match="unknown config field 'num_layer'"):
        cfg.replace(num_layer=8)


def test_vocab_size_is_taken_from_the_tokenizer_before_validation(tmp_path):
    cfg = config_from_values(dict(BASE, vocab_size=None, tokenizer_type="ByteTokenizer"))
    resolved = resolve_vocab(cfg)
    assert resolved.model.vocab_size == ByteTokenizer.vocab_size and cfg.model.vocab_size is None
    validate(resolved, 1)
    # the whole run: the embedding is built from the tokenizer's size (no --vocab-size given)
    log = tmp_path / "log.jsonl"
    flags = [
        "--mock-data",
        "--tokenizer-type",
        "ByteTokenizer",
        "--make-vocab-size-divisible-by",
        "64",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "1",
        "--train-iters",
        "1",
        "--log-interval",
        "1",
        "--device",
        "cpu",
        "--log-file",
        str(log),
    ]
    assert pretrain_m6.main(flags) == 0
    assert math.isfinite(json.loads(log.read_text().splitlines()[-1])["lm_loss"])
