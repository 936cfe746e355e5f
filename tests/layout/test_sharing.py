"""Share patterns (pure maps) and the one-process pseudo model against an explicit reference."""

import copy

import pytest
import torch

from megatron_p2r.config import ConfigError, parse_share_pattern
from megatron_p2r.layout.sharing import layer_module_keys, layer_to_slot, slot_to_layers, stages_using_slot
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from tests.helpers import random_microbatches, tiny_config


def test_slot_maps_follow_their_definitions():
    assert layer_to_slot("none", 4) == [0, 1, 2, 3]
    assert layer_to_slot("all", 4) == [0, 0, 0, 0]
    assert layer_to_slot("cycle:2", 6) == [0, 1, 0, 1, 0, 1]
    assert layer_to_slot("cycle:4", 6) == [0, 1, 2, 3, 0, 1]
    assert layer_to_slot("block:2", 6) == [0, 0, 0, 1, 1, 1]
    assert layer_to_slot("block:3", 6) == [0, 0, 1, 1, 2, 2]
    assert slot_to_layers(layer_to_slot("cycle:2", 4)) == {0: [0, 2], 1: [1, 3]}
    assert stages_using_slot(layer_to_slot("cycle:2", 4), [range(0, 2), range(2, 4)]) == {0: [0, 1], 1: [0, 1]}
    assert stages_using_slot(layer_to_slot("block:2", 4), [range(0, 2), range(2, 4)]) == {0: [0], 1: [1]}


def test_module_keys_separate_dense_and_moe_layers():
    moe_every_other = [False, True, False, True]
    assert layer_module_keys("all", 4, moe_every_other) == [0, 1, 0, 1]
    assert layer_module_keys("block:2", 4, [False] * 4) == [0, 0, 2, 2]
    assert layer_module_keys("none", 4, moe_every_other) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "pattern,message",
    [
        ("cycle", "needs an integer K"),
        ("block:3", "must divide"),
        ("cycle:9", "between 1 and"),
        ("every:2", "expected all, none"),
    ],
)
def test_bad_patterns(pattern, message):
    with pytest.raises(ConfigError, match=message):
        parse_share_pattern(pattern, 4)


def _reference_loss(model, mb, num_layers):
    """An independent forward: the one shared layer module applied ``num_layers`` times."""
    ref = copy.deepcopy(model)
    layer = ref.layers["0"]
    x = ref.embedding(mb["tokens"])
    for _ in range(num_layers):
        x = layer(x)
    logits = torch.nn.functional.linear(ref.final_norm(x), ref.embedding.word_embeddings.weight)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten())
    loss.backward()
    return loss.item(), ref


def test_share_all_equals_one_module_applied_l_times():
    cfg = tiny_config(num_layers=4, p2r_phase="pseudo", share_pattern="all")
    model = build_model(cfg, ParallelState.single())
    assert list(model.layers) == ["0"] and model.layer_keys == [0, 0, 0, 0]
    mb = random_microbatches(cfg, 1, 2)[0]
    loss = forward_backward_no_pipelining(model, [mb], ParallelState.single()).item()
    ref_loss, ref = _reference_loss(model, mb, 4)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)


def test_parameter_count_matches_the_formula():
    """Layer parameters shrink by the sharing factor; embeddings and final norm do not."""
    h, f, L, v = 32, 128, 4, 208  # tiny_config: hidden 32, ffn 4h, vocab 200 padded to 208
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h  # qkv, proj, fc1, fc2, 2 norms
    shared = v * h + 16 * h + 2 * h  # word + position embeddings (seq 16) + final norm
    counts = {}
    for phase, pattern, slots in [
        ("real", "all", L),
        ("pseudo", "all", 1),
        ("pseudo", "cycle:2", 2),
        ("pseudo", "block:2", 2),
    ]:
        model = build_model(
            tiny_config(num_layers=L, p2r_phase=phase, share_pattern=pattern), ParallelState.single(), meta=True
        )
        counts[(phase, pattern)] = sum(p.numel() for p in model.parameters())
        assert counts[(phase, pattern)] == shared + slots * per_layer, (phase, pattern)
    real_layers = counts[("real", "all")] - shared
    assert real_layers == L * (counts[("pseudo", "all")] - shared)
