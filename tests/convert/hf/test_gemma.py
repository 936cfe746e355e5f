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
    # the full layer's rotary linear by 8, the sliding layers' unscaled; logits over 64 positions
    "gemma3_linear": (
        GEMMA3,
        dict(
            GEMMA,
            window_attn_skip_freq=3,
            qk_layernorm=True,
            rotary_base=1e6,
            rotary_base_local=1e4,
            rotary_seq_len_interpolation_factor=8,
        ),
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
    positions = theirs.config.max_position_embeddings
    check_same_function(ours, theirs, 101, positions, generate=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert result.architecture == arch
    back = load_hf(str(tmp_path / "back"))
    assert type(back).__name__ == arch
    assert back.config.rope_parameters == theirs.config.rope_parameters
    check_same_function(ours, back, 101, positions)


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
        ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a number"),
        (
            "gemma3_text",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}}},
            "rope_parameters.full_attention.rope_type 'yarn': Gemma's rotary here is default or linear",
        ),
        ("gemma3_text", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic'"),
        ("gemma2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type 'dynamic'"),
        (
            "gemma3_text",
            {"rope_scaling": {"type": "linear", "factor": 8.0}},
            "rope_scaling.type 'linear' with rope_type 'default': transformers 5 rotates",
        ),
        (
            "gemma3_linear",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "rope_parameters.sliding_attention.rope_type 'linear' with full layers' 'linear'",
        ),
        (
            "gemma3_linear",
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.5}}},
            "rope type 'linear' with",
        ),
        (
            "gemma3_text",
            {"rope_parameters": {"rope_type": "linear", "factor": 8.0}},
            "rope_parameters has ['factor', 'rope_type']: Gemma 3's is keyed by layer type",
        ),
    ],
)
def test_gemma_fields_without_equivalent_are_refused(family, change, message, tmp_path):
    with pytest.raises(HFConversionError, match="config.json: " + re.escape(message)):
        import_hf(_edited(family, change, tmp_path), str(tmp_path / "ours"), Target(), progress=False)


def _edited(family, change, tmp_path):
    """A copy of a fixture whose config.json is updated with ``change`` (None values removed)."""
    shutil.copytree(_fixture(family), tmp_path / "hf")
    config = {**json.load(open(tmp_path / "hf" / "config.json")), **change}
    json.dump({k: v for k, v in config.items() if v is not None}, open(tmp_path / "hf" / "config.json", "w"))
    return str(tmp_path / "hf")


def test_gemma3_older_rope_fields_read_as_transformers_reads_them():
    """Released Gemma 3 4B-27B write ``rope_scaling`` (linear 8: the full layers'), ``rope_theta`` and
    ``rope_local_base_freq``: transformers' Gemma3TextConfig makes of them the per-layer-type
    rope_parameters of the gemma3_linear fixture, and import reads both alike; a sliding base
    given in rope_parameters is --rotary-base-local."""
    from transformers import Gemma3TextConfig

    from megatron_p2r.convert.hf.config_json import model_values_from_hf

    config = json.load(open(os.path.join(_fixture("gemma3_linear"), "config.json")))
    released = {k: v for k, v in config.items() if k != "rope_parameters"}
    released.update(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4)
    assert Gemma3TextConfig.from_dict(released).rope_parameters == config["rope_parameters"]
    assert model_values_from_hf(released, "config.json") == model_values_from_hf(config, "config.json")
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 2e4
    assert model_values_from_hf(config, "config.json")[1]["rotary_base_local"] == 2e4


LINEAR_8 = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}


@pytest.mark.parametrize(
    "family, rope, factor",
    [
        # Gemma 3 with one rotary for every layer, linear on the sliding layers too: no local base
        ("gemma3_linear", {"full_attention": LINEAR_8, "sliding_attention": LINEAR_8}, 8),
        # Gemma 2's one rotary, linear by 8
        ("gemma2", LINEAR_8, 8),
    ],
)
def test_one_scaled_rotary_for_every_layer_round_trips(family, rope, factor, tmp_path):
    """Linear scaling on every layer (no --rotary-base-local) imports as
    --rotary-seq-len-interpolation-factor alone and exports as the same rope_parameters; logits
    equal transformers' over the fixture's positions (64 for gemma3_linear)."""
    hf = _edited(family, {"rope_parameters": rope}, tmp_path)
    theirs = load_hf(hf)
    import_hf(hf, str(tmp_path / "ours"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    assert (cfg.model.rotary_base_local, cfg.model.rotary_seq_len_interpolation_factor) == (None, factor)
    positions = theirs.config.max_position_embeddings
    check_same_function(ours, theirs, 101, positions, generate=False)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    back = load_hf(str(tmp_path / "back"))
    assert back.config.rope_parameters == theirs.config.rope_parameters
    check_same_function(ours, back, 101, positions, generate=False)


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
    hf = _edited("gemma2", {"layer_types": ["full_attention"] * 2}, tmp_path)
    theirs = load_hf(hf)
    import_hf(hf, str(tmp_path / "ours"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    assert cfg.model.window_size is None
    check_same_function(ours, theirs, 101, 16, generate=False)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert json.load(open(tmp_path / "back" / "config.json"))["layer_types"] == ["full_attention"] * 2
    check_same_function(ours, load_hf(str(tmp_path / "back")), 101, 16)


def test_released_multimodal_gemma3_imports_through_its_language_model(tmp_path):
    """Gemma 3 4B-27B are released as Gemma3ForConditionalGeneration (model_type gemma3, refused by
    name); docs/hf.md's recipe saves its language model as Gemma3ForCausalLM, which imports with
    the multimodal model's text logits (a tiny one written by transformers around the gemma3_linear
    fixture's language model)."""
    import transformers as t

    text = json.load(open(os.path.join(_fixture("gemma3_linear"), "config.json")))
    vision = t.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    released = t.Gemma3ForConditionalGeneration(
        t.Gemma3Config(
            text_config={k: v for k, v in text.items() if k not in ("architectures", "transformers_version")},
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            image_token_index=100,
            boi_token_index=98,
            eoi_token_index=99,
        )
    ).eval()
    released.model.language_model.load_state_dict(load_hf(_fixture("gemma3_linear")).model.state_dict())
    released.save_pretrained(tmp_path / "released")
    with pytest.raises(HFConversionError, match="model_type 'gemma3' is not supported: this is Gemma 3's multimodal"):
        import_hf(str(tmp_path / "released"), str(tmp_path / "refused"), Target(), progress=False)
    # docs/hf.md's recipe
    released = t.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "released")
    text_only = t.Gemma3ForCausalLM(released.config.text_config)
    text_only.model.load_state_dict(released.model.language_model.state_dict())
    text_only.lm_head.load_state_dict(released.lm_head.state_dict())
    text_only.save_pretrained(tmp_path / "text")
    import_hf(str(tmp_path / "text"), str(tmp_path / "ours"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    assert (cfg.model.rotary_seq_len_interpolation_factor, cfg.model.rotary_base_local) == (8, 1e4)
    check_same_function(ours, _TextLogits(released), 98, 64, generate=False)


class _TextLogits(torch.nn.Module):
    """The multimodal model's forward on text ids, as check_same_function calls transformers'."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)
