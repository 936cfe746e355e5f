"""--moe-layer-freq: Megatron-LM's integer rule and list expressions, read without eval."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_p2r.arguments import parse_args, to_argv
from megatron_p2r.checkpoint.metadata import MOE_LAYERS_FROM_0, metadata_config, read_metadata
from megatron_p2r.config import ConfigError, check_values
from megatron_p2r.config.layer_pattern import expand_layer_pattern, layer_pattern_text, parse_layer_pattern
from megatron_p2r.config.model import ModelConfig

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


@pytest.mark.parametrize(
    "text, value",
    [
        ("1", 1),
        ("3", 3),
        ("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]),
        ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0] * 2),  # Megatron's docstring example
        ("[0,1,1]", [0, 1, 1]),
        ("2*[1,0]", [1, 0, 1, 0]),
    ],
)
def test_megatron_forms_parse(text, value):
    assert parse_layer_pattern(text) == value


@pytest.mark.parametrize(
    "text", ["0", "-1", "[0]*3+[2]", "[[1]]", "[1]*3+1", "__import__('os').system('true')", "[1]*(2**40)", "", "1.5"]
)
def test_anything_else_is_refused(text):
    with pytest.raises(ValueError):
        parse_layer_pattern(text)


def test_the_integer_rule_is_megatrons():
    """megatron-core's gpt_layer_specs: layer i is MoE when i % N == 0 (0, N, 2N, ...)."""
    assert expand_layer_pattern(2, 5) == [1, 0, 1, 0, 1]
    assert expand_layer_pattern(3, 4) == [1, 0, 0, 1]
    m = ModelConfig(num_layers=4, num_experts=4, moe_layer_freq=2)
    assert [m.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    m = ModelConfig(num_layers=4, num_experts=4, moe_layer_freq=[0, 1, 1, 1])
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True] and not m.all_layers_moe


def test_the_flag_takes_the_list_and_writes_it_back():
    argv = ["--num-layers", "8", "--num-experts", "4", "--moe-layer-freq", "([0]*3+[1]*5)"]
    cfg = parse_args(argv)
    assert cfg.model.moe_layer_freq == [0, 0, 0, 1, 1, 1, 1, 1]
    assert layer_pattern_text(cfg.model.moe_layer_freq) == "([0]*3+[1]*5)"
    assert parse_args(to_argv(cfg)).model.moe_layer_freq == cfg.model.moe_layer_freq


def test_a_pattern_of_the_wrong_length_is_refused():
    m = ModelConfig(num_layers=4, num_experts=4, moe_layer_freq=[0, 1])
    with pytest.raises(ConfigError, match=r"--moe-layer-freq lists 2 layers, expected one 0/1 for each of the 4"):
        m.check()


def test_a_wrong_value_names_the_flag():
    cfg = parse_args(["--num-experts", "4"])
    for bad in ([0, 2, 1, 1], "2", 0):
        with pytest.raises(ConfigError, match="--moe-layer-freq"):
            check_values(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_layer_freq=bad)))


def test_a_checkpoint_written_before_the_megatron_rule_keeps_its_layers():
    """metadata.json without the marker (the Adafactor fixture, written by older code with
    --moe-layer-freq 2 and 2 layers): an integer N meant layers N-1, 2N-1, ..., read as that list."""
    meta = read_metadata(os.path.join(FIXTURES, "adafactor_broadcast", "ckpt", "iter_0000002"))
    assert MOE_LAYERS_FROM_0 not in meta and meta["config"]["model"]["moe_layer_freq"] == 2
    assert metadata_config(meta).model.moe_layer_freq == [0, 1]
    assert metadata_config({**meta, MOE_LAYERS_FROM_0: True}).model.moe_layer_freq == 2


def test_window_layers_follow_megatrons_rule():
    """is_layer_window_attention: an integer N leaves layers N-1, 2N-1, ... full; a list's 1s are windowed."""
    window = dict(num_layers=4, window_size="3,0")
    assert [ModelConfig(**window, window_attn_skip_freq=2).attention_window(i) for i in range(4)] == [3, None, 3, None]
    listed = ModelConfig(**window, window_attn_skip_freq=[1, 0, 0, 1])
    assert [listed.attention_window(i) for i in range(4)] == [3, None, None, 3]
    with pytest.raises(ConfigError, match="--window-attn-skip-freq lists 3 layers"):
        ModelConfig(**window, window_attn_skip_freq=[1, 0, 1]).check()


def test_a_model_with_a_listed_pattern_stays_hashable():
    """Caches keyed by the model (MLA's rotary tables, on CUDA too) need a hash; a list field has none."""
    listed = dict(num_layers=4, num_experts=4, moe_layer_freq=[0, 1, 1, 1], window_size="3,0")
    a, b = (
        ModelConfig(**listed, window_attn_skip_freq=[1, 0, 1, 1]),
        ModelConfig(**listed, window_attn_skip_freq=[1, 0, 1, 1]),
    )
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert hash(a) != hash(ModelConfig(**{**listed, "moe_layer_freq": [1, 1, 1, 1]}))
