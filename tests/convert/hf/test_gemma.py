"""Gemma 2 and Gemma 3 (docs/hf.md), on tiny models written by transformers' own classes
(tests/fixtures/hf_families/make_fixtures.py):

- import-hf under TP 2 computes transformers' logits (fp32, rtol/atol 1e-5), and export-hf of
  that checkpoint loads in transformers as the same class with the same logits;
- the (1 + w) norm weights: ours is bitwise transformers' factor 1 + w, and the exported w gives it back;
- the imported models train: 2 steps under TP 2 (Gemma 2 also under PP 2, its final soft-cap on
  the last stage) on 2 gloo ranks give the losses of the one-process import (rel 1e-5);
- what has no equivalent is refused naming the field.
"""

import json
import os
import re
import shutil

import pytest
import torch

from megatron_p2r.convert.hf.architecture import GEMMA2, GEMMA3, HFConversionError, hf_architecture
from megatron_p2r.convert.hf.directory import HFDirectory
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.reshard import Target
from tests.convert.hf.common import check_same_function, load_hf, reference_model
from tests.convert.hf.test_families import _losses, _train_values
from tests.harness import run_distributed

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "hf_families")
GEMMA = dict(geglu=True, swiglu=False, layer_norms="both", softmax_scale=16**-0.5, window_size="4,0")
FAMILIES = {
    "gemma2": (
        GEMMA2,
        dict(
            GEMMA,
            window_attn_skip_freq=2,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            embedding_multiplier=float(torch.tensor(32**0.5)),
        ),
    ),
    "gemma3_text": (
        GEMMA3,
        dict(GEMMA, window_attn_skip_freq=3, qk_layernorm=True, rotary_base=1e6, rotary_base_local=1e4),
    ),
}


def _fixture(family):
    return os.path.join(FIXTURES, family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_same_logits(family, tmp_path):
    arch, expected = FAMILIES[family]
    theirs = load_hf(_fixture(family))
    import_hf(_fixture(family), str(tmp_path / "ours"), Target(2), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    m = cfg.model
    assert {k: getattr(m, k) for k in expected} == expected
    check_same_function(ours, theirs, 101, 16, generate=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert result.architecture == arch
    back = load_hf(str(tmp_path / "back"))
    assert type(back).__name__ == arch
    check_same_function(ours, back, 101, 16)


def test_one_plus_w_norm_weights_are_bitwise(tmp_path):
    """Our norm weight is transformers' factor ``1.0 + w.float()`` bit for bit, and so is the
    factor of the exported weight; our norms' outputs are Gemma3RMSNorm's bit for bit (fp32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    import_hf(_fixture("gemma3_text"), str(tmp_path / "ours"), Target(1), progress=False)
    ours, _ = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), progress=False)
    hf, back = HFDirectory(_fixture("gemma3_text")), HFDirectory(str(tmp_path / "back"))
    pairs = {
        "layers.2.post_attention_norm.weight": "model.layers.2.pre_feedforward_layernorm.weight",
        "layers.0.attention_output_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "layers.2.attention.k_layernorm.weight": "model.layers.2.self_attn.k_norm.weight",
        "final_norm.weight": "model.norm.weight",
    }
    params, modules = dict(ours.named_parameters()), dict(ours.named_modules())
    x = torch.randn(2, 16, 32) * 3
    for mine, theirs in pairs.items():
        assert torch.equal(params[mine].detach(), 1.0 + hf.read(theirs).float()), mine
        assert torch.equal(params[mine].detach(), 1.0 + back.read(theirs).float()), mine
        # and the norms compute transformers' x * rsqrt(mean(x^2) + eps) * (1.0 + w.float()) bit for bit
        reference = Gemma3RMSNorm(hf.read(theirs).shape[0], eps=1e-6)
        reference.weight.data = hf.read(theirs).float()
        rows = x.reshape(-1, reference.weight.shape[0])
        with torch.no_grad():
            assert torch.equal(modules[mine.removesuffix(".weight")](rows), reference(rows)), mine


def test_imported_gemmas_train_as_one_process(tmp_path):
    """2 training steps under TP 2 (Gemma 2 with sequence parallelism, and under PP 2: the final
    soft-cap on the last stage) equal the one-process import's."""
    layouts = {
        "gemma2_tp2": ("gemma2", Target(2)),
        "gemma2_pp2": ("gemma2", Target(1, 2)),
        "gemma3": ("gemma3_text", Target(2)),
    }
    runs, single = {}, {}
    for name, (family, target) in layouts.items():
        import_hf(_fixture(family), str(tmp_path / name), target, make_vocab_size_divisible_by=8, progress=False)
        runs[name] = _train_values(str(tmp_path / name))
        if name == "gemma2_tp2":  # the soft-capped loss on sequence shards too
            runs[name]["sequence_parallel"] = True
        if family not in single:
            import_hf(
                _fixture(family), str(tmp_path / family), Target(1), make_vocab_size_divisible_by=8, progress=False
            )
            single[family] = _train_values(str(tmp_path / family))
    parallel = run_distributed(_losses, 2, runs, timeout=300)[0]
    reference = _losses(0, 1, single)
    for name, (family, _) in layouts.items():
        assert len(reference[family]) == 2 and reference[family][0] != reference[family][1]
        assert parallel[name] == pytest.approx(reference[family], rel=1e-5), name


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu': the gated GELU here is the tanh one"),
        ("gemma2", {"attention_bias": True}, "attention_bias true"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
        (
            "gemma3_text",
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}},
            "rope_parameters.full_attention.rope_type 'linear'",
        ),
        ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a number"),
    ],
)
def test_gemma_fields_without_equivalent_are_refused(family, change, message, tmp_path):
    shutil.copytree(_fixture(family), tmp_path / "hf")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
    with pytest.raises(HFConversionError, match="config.json: " + re.escape(message)):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(), progress=False)


def test_gemma_options_are_refused_elsewhere_and_checked_on_gemma():
    from tests.convert.hf.common import ROPE
    from tests.helpers import tiny_config

    m = tiny_config(**ROPE, attn_logit_softcapping=2.0, disable_bias_linear=True).model
    with pytest.raises(HFConversionError, match=r"--attn-logit-softcapping \(Llama has none; Gemma has it\)"):
        hf_architecture(m)
    gemma = dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        geglu=True,
        layer_norms="both",
        disable_bias_linear=True,
    )
    m = tiny_config(**gemma).model  # no embedding multiplier: Gemma always scales by sqrt(hidden)
    with pytest.raises(HFConversionError, match=r"maps to Gemma2ForCausalLM .* --embedding-multiplier 1.0"):
        hf_architecture(m)
    hidden = tiny_config().model.hidden_size
    m = tiny_config(**gemma, embedding_multiplier=hidden**0.5, softmax_scale=0.3).model
    with pytest.raises(HFConversionError, match=r"--softmax-scale 0.3 \(Gemma2's is query_pre_attn_scalar"):
        hf_architecture(m)


def test_gemma3_default_layer_types_are_every_sixth_full():
    """A config.json without layer_types: transformers' default for Gemma 3, every 6th layer full
    (sliding_window_pattern), becomes --window-attn-skip-freq 6; Gemma 2's every 2nd."""
    from megatron_p2r.convert.hf.config_json import model_values_from_hf

    for family, every in (("gemma3_text", 6), ("gemma2", 2)):
        config = json.load(open(os.path.join(_fixture(family), "config.json")))
        config = {k: v for k, v in config.items() if k not in ("layer_types", "sliding_window_pattern")}
        _, values = model_values_from_hf({**config, "num_hidden_layers": 12}, "config.json")
        assert (values["window_size"], values["window_attn_skip_freq"]) == ("4,0", every), family


def test_gemma_options_block_megatron_export():
    """Megatron-LM has no flags for Gemma's four options: export to Megatron names each."""
    from megatron_p2r.convert.megatron.args import MegatronConversionError
    from megatron_p2r.convert.megatron.export_args import MegatronLayout, megatron_args
    from tests.convert.hf.common import ROPE
    from tests.helpers import tiny_config

    options = dict(
        geglu=True,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        window_size="4,0",
        rotary_base_local=100.0,
    )
    cfg = tiny_config(**dict(ROPE, swiglu=False), **options)
    with pytest.raises(MegatronConversionError, match="cannot express this model in Megatron-LM's args") as exc:
        megatron_args(cfg, MegatronLayout(1, 1, 1, "torch_dist"), iteration=0, consumed_samples=0, dtype="float32")
    for flag in (
        "--geglu True",
        "--attn-logit-softcapping 50.0",
        "--final-logit-softcapping 30.0",
        "--rotary-base-local",
    ):
        assert flag in str(exc.value)


def test_embedding_multiplier_is_sqrt_hidden_in_the_weights_dtype():
    """transformers multiplies by sqrt(hidden) rounded to the weights' dtype (Gemma's 55.4256 -> 55.5 in bf16)."""
    from megatron_p2r.convert.hf.config_json import model_values_from_hf

    config = json.load(open(os.path.join(_fixture("gemma2"), "config.json")))
    for dtype, want in (("float32", float(torch.tensor(3072**0.5))), ("bfloat16", 55.5)):
        _, values = model_values_from_hf({**config, "hidden_size": 3072, "dtype": dtype}, "config.json")
        assert values["embedding_multiplier"] == want, dtype


def test_gemma_without_windows_round_trips(tmp_path):
    """Every layer full: imported without --window-size, exported with every layer full_attention."""
    shutil.copytree(_fixture("gemma2"), tmp_path / "hf")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump({**config, "layer_types": ["full_attention"] * 2}, open(tmp_path / "hf" / "config.json", "w"))
    theirs = load_hf(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    assert cfg.model.window_size is None
    check_same_function(ours, theirs, 101, 16, generate=False)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert json.load(open(tmp_path / "back" / "config.json"))["layer_types"] == ["full_attention"] * 2
    check_same_function(ours, load_hf(str(tmp_path / "back")), 101, 16)
