"""The Hugging Face families beyond GPT2/Llama/Mistral/Mixtral/Qwen2 (docs/hf.md), on tiny models
written by transformers' own classes (tests/fixtures/hf_families/make_fixtures.py):

- import-hf under TP 2 (experts: EP 2) computes transformers' logits (fp32, rtol/atol 1e-5);
- export-hf of that checkpoint loads in transformers as the same class, same logits and greedy tokens;
- the imported model trains: 2 steps under TP 2 (EP 2) on 2 gloo ranks give the losses of the
  one-process import (rel 1e-5);
- the families still refused are refused by name with the reason.
"""

import json
import os
import re
import shutil

import pytest

from megatron_p2r.arguments import config_from_values, load_yaml
from megatron_p2r.convert.hf.architecture import (
    GPT_OSS,
    GRANITE,
    GRANITE_MOE,
    OLMO2,
    QWEN3,
    QWEN3_MOE,
    HFConversionError,
)
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.reshard import Target
from tests.convert.hf.common import check_same_function, load_hf, reference_model
from tests.harness import run_distributed

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "hf_families")
SCALES = dict(embedding_multiplier=3.0, residual_multiplier=0.5, softmax_scale=0.25, logits_scaling=2.0)
# family -> (HF class, target layout, what the import must have set)
FAMILIES = {
    "qwen3": (QWEN3, Target(2), dict(qk_layernorm=True, window_size="4,0", window_attn_skip_freq=2)),
    "qwen3_moe": (
        QWEN3_MOE,
        Target(1, 1, None, 2),
        dict(
            qk_layernorm=True, num_experts=4, moe_layer_freq=[0, 1], moe_router_pre_softmax=True, moe_ffn_hidden_size=24
        ),
    ),
    "olmo2": (OLMO2, Target(2), dict(layer_norms="output", qk_layernorm=True, qk_layernorm_over_heads=True)),
    "granite": (GRANITE, Target(2), dict(SCALES, disable_bias_linear=False)),
    "granitemoe": (GRANITE_MOE, Target(1, 1, None, 2), dict(SCALES, num_experts=4, moe_router_pre_softmax=False)),
    "gpt_oss": (
        GPT_OSS,
        Target(1, 1, None, 2),
        dict(
            softmax_type="learnable",
            quick_geglu=True,
            glu_linear_offset=1.0,
            activation_func_clamp_value=2.0,
            window_size="4,0",
            window_attn_skip_freq=2,
            disable_bias_linear=False,
            rope_type="yarn",
            rotary_scaling_factor=8.0,
            yarn_original_max_position_embeddings=2000,
            yarn_correction_range_round_to_int=False,
        ),
    ),
}
REFUSED = ["gemma3"]


def _fixture(family):
    return os.path.join(FIXTURES, family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_same_logits(family, tmp_path):
    arch, target, expected = FAMILIES[family]
    theirs = load_hf(_fixture(family))
    import_hf(_fixture(family), str(tmp_path / "ours"), target, make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    m = cfg.model
    assert {k: getattr(m, k) for k in expected} == expected
    check_same_function(ours, theirs, 101, 16, generate=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert result.architecture == arch
    back = load_hf(str(tmp_path / "back"))
    assert type(back).__name__ == arch
    check_same_function(ours, back, 101, 16)


def _losses(rank, world, runs):
    from megatron_p2r.training import pretrain

    return {name: pretrain(config_from_values(values))["losses"] for name, values in runs.items()}


def _train_values(directory):
    return {
        **load_yaml(os.path.join(directory, "model.yaml")),
        "load": directory,
        "finetune": True,
        "vocab_size": 101,
        "seq_length": 16,  # gpt-oss's YaRN context is 16000 positions: import would train on 4096
        "mock_data": True,
        "seed": 7,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "train_iters": 2,
        "lr": 1e-2,
        "lr_decay_style": "constant",
        "clip_grad": 0.0,
        "device": "cpu",
        "log_interval": 100,
        "eval_iters": 0,
    }


def test_imported_families_train_as_one_process(tmp_path):
    """2 training steps of each imported family under its layout (2 ranks) equal the one-process
    import's (the step-2 loss is after one update: the gradients went through every mapped weight)."""
    runs, single = {}, {}
    for family, (_, target, _) in FAMILIES.items():
        for name, layout, out in ((family, target, runs), (family + "_1", Target(1), single)):
            import_hf(_fixture(family), str(tmp_path / name), layout, make_vocab_size_divisible_by=8, progress=False)
            out[family] = _train_values(str(tmp_path / name))
    parallel = run_distributed(_losses, 2, runs, timeout=300)[0]
    reference = _losses(0, 1, single)
    for family in FAMILIES:
        assert len(reference[family]) == 2 and reference[family][0] != reference[family][1]
        assert parallel[family] == pytest.approx(reference[family], rel=1e-5), family


def test_gpt_oss_trains_under_tp_pp_and_distributed_optimizer_as_one_process(tmp_path):
    """gpt-oss (router bias, sinks, YaRN, expert biases) imported under TP 2 with sequence
    parallelism (the router and its bias replicated, their gradients partial), PP 2, and EP 2 with
    the distributed optimizer: 2 steps give the one-process import's losses."""
    layouts = {
        "tp2": (Target(2), dict(sequence_parallel=True)),
        "pp2": (Target(1, 2), {}),
        "ep2_distopt": (Target(1, 1, None, 2), dict(use_distributed_optimizer=True)),
    }
    runs = {}
    for name, (layout, extra) in layouts.items():
        import_hf(_fixture("gpt_oss"), str(tmp_path / name), layout, make_vocab_size_divisible_by=8, progress=False)
        runs[name] = {**_train_values(str(tmp_path / name)), **extra}
    import_hf(_fixture("gpt_oss"), str(tmp_path / "one"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    reference = _losses(0, 1, {"one": _train_values(str(tmp_path / "one"))})["one"]
    parallel = run_distributed(_losses, 2, runs, timeout=300)[0]
    assert len(reference) == 2 and reference[0] != reference[1]
    for name in layouts:
        assert parallel[name] == pytest.approx(reference, rel=1e-5), name


@pytest.mark.parametrize("family", REFUSED)
def test_refused_by_name(family, tmp_path):
    os.makedirs(tmp_path / "hf")
    json.dump({"model_type": family, "vocab_size": 101}, open(tmp_path / "hf" / "config.json", "w"))
    with pytest.raises(HFConversionError, match=f"model_type '{family}' is not supported: "):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(), progress=False)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias true (query/key/value and output biases without MLP"),
        ("granitemoe", {"attention_bias": True}, "attention_bias true"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, None),  # layer 0 is dense already: imports
    ],
)
def test_family_fields_without_equivalent_are_refused(family, change, message, tmp_path):
    shutil.copytree(_fixture(family), tmp_path / "hf")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
    if message is None:
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(), progress=False)
        return
    with pytest.raises(HFConversionError, match="config.json: " + re.escape(message)):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(), progress=False)


def test_family_options_block_megatron_export():
    """Megatron-LM has no flags for Granite's multipliers or OLMo 2's norms: export to Megatron names each."""
    from megatron_p2r.convert.megatron.args import MegatronConversionError
    from megatron_p2r.convert.megatron.export_args import MegatronLayout, megatron_args
    from tests.convert.hf.common import ROPE
    from tests.helpers import tiny_config

    cfg = tiny_config(
        **ROPE,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        softmax_scale=0.25,
        logits_scaling=2.0,
        layer_norms="output",
        qk_layernorm=True,
        qk_layernorm_over_heads=True,
    )
    with pytest.raises(MegatronConversionError, match="cannot express this model in Megatron-LM's args") as exc:
        megatron_args(cfg, MegatronLayout(1, 1, 1, "torch_dist"), iteration=0, consumed_samples=0, dtype="float32")
    for flag in (
        "--embedding-multiplier 3.0",
        "--residual-multiplier 0.5",
        "--softmax-scale 0.25",
        "--logits-scaling",
        "--layer-norms 'output'",
        "--qk-layernorm-over-heads True",
    ):
        assert flag in str(exc.value)
