"""YaRN for standard attention (--rope-type yarn, model/yarn.py) against transformers' own rotary
embedding (GptOssRotaryEmbedding: ``_compute_yarn_parameters``), which megatron-core's
YarnRotaryEmbedding computes alike: the frequencies blended over the correction range, rounded
or not, and the tables times the attention factor. fp32 on both sides, same formula: 1e-6."""

import pytest
import torch

from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from megatron_p2r.model.attention import model_rotary_tables
from megatron_p2r.model.yarn import yarn_concentration
from tests.helpers import tiny_config

transformers = pytest.importorskip("transformers")

ROPE = dict(position_embedding_type="rope", normalization="RMSNorm", kv_channels=16, seq_length=64)
CASES = [
    # gpt-oss's: factor 32, betas 32/1 over 4096, not rounded, the default attention factor
    dict(factor=32.0, original=4096, beta_fast=32.0, beta_slow=1.0, truncate=False, base=150000.0),
    # rounded (transformers' and megatron-core's default), other betas and base
    dict(factor=4.0, original=512, beta_fast=16.0, beta_slow=2.0, truncate=True, base=10000.0),
    # mscale and mscale_all_dim both given: their ratio is the attention factor
    dict(factor=8.0, original=2000, beta_fast=32.0, beta_slow=1.0, truncate=False, base=10000.0, mscale=(1.5, 0.5)),
]


def _ours(case):
    mscale, mscale_all_dim = case.get("mscale", (1.0, 0.0))
    return tiny_config(
        **ROPE,
        rope_type="yarn",
        rotary_base=case["base"],
        rotary_scaling_factor=case["factor"],
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        yarn_original_max_position_embeddings=case["original"],
        yarn_beta_fast=case["beta_fast"],
        yarn_beta_slow=case["beta_slow"],
        yarn_correction_range_round_to_int=case["truncate"],
    )


def _theirs(case):
    rope = {
        "rope_type": "yarn",
        "rope_theta": case["base"],
        "factor": case["factor"],
        "original_max_position_embeddings": case["original"],
        "beta_fast": case["beta_fast"],
        "beta_slow": case["beta_slow"],
        "truncate": case["truncate"],
    }
    if "mscale" in case:
        rope.update(mscale=case["mscale"][0], mscale_all_dim=case["mscale"][1])
    cfg = transformers.GptOssConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=64, rope_parameters=rope
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, 64, 64), torch.arange(64)[None])
    return cos[0], sin[0]  # [s, head_dim / 2]: transformers' gpt-oss rotates halves with them


@pytest.mark.parametrize("case", CASES)
def test_yarn_tables_are_transformers(case):
    cfg = _ours(case)
    validate(cfg, 1)
    cos, sin = model_rotary_tables(cfg.model, 64, "cpu")
    want_cos, want_sin = _theirs(case)
    torch.testing.assert_close(cos, want_cos.repeat(1, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin.repeat(1, 2), rtol=0, atol=1e-6)
    # the attention factor is there (position 0: cos = the factor), and not 1
    factor = yarn_concentration(case["factor"], *case.get("mscale", (1.0, 0.0)))
    assert cos[0, 0].item() == pytest.approx(factor) and factor > 1.05


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rotary_percent=0.5), "--rope-type yarn with --rotary-percent 0.5: YaRN's tables rotate whole heads"),
        (dict(use_rope_scaling=True), "--rope-type yarn with --use-rope-scaling"),
        (dict(position_embedding_type="learned_absolute"), "--rope-type yarn scales rotary embeddings"),
    ],
)
def test_yarn_refuses_what_it_does_not_combine_with(options, message):
    cfg = tiny_config(**{**ROPE, "rope_type": "yarn", "rotary_scaling_factor": 4.0, **options})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, 1)


def test_yarn_options_need_yarn():
    cfg = tiny_config(**ROPE, yarn_original_max_position_embeddings=8192)
    with pytest.raises(ConfigError, match="--yarn-original-max-position-embeddings configures YaRN: it needs"):
        validate(cfg, 1)


def test_latent_attention_keeps_megatron_cores_fixed_yarn():
    """megatron-core's MLA reads none of the yarn_* fields: setting one with MLA is an error."""
    mla = dict(multi_latent_attention=True, position_embedding_type="rope", normalization="RMSNorm")
    cfg = tiny_config(**mla, yarn_beta_fast=16.0)
    with pytest.raises(ConfigError, match="--yarn-beta-fast is refused with --multi-latent-attention"):
        validate(cfg, 1)
    cfg = tiny_config(**mla, yarn_correction_range_round_to_int=False)
    with pytest.raises(ConfigError, match="--no-yarn-correction-range-round-to-int is refused"):
        validate(cfg, 1)


def test_export_megatron_refuses_standard_attention_yarn():
    from megatron_p2r.convert.megatron.args import MegatronConversionError
    from megatron_p2r.convert.megatron.export_args import check_expressible

    with pytest.raises(MegatronConversionError, match=r"--rope-type yarn \(Megatron-LM's command line builds YaRN"):
        check_expressible(_ours(CASES[0]).model)


# --mscale 2 alone: transformers would ignore mscale without mscale_all_dim, so its attention_factor is written
EXPORTED = CASES + [dict(CASES[2], mscale=(2.0, 0.0))]


@pytest.mark.parametrize("case", EXPORTED)
def test_hf_export_carries_yarn_and_import_reads_it(case):
    """A Llama with --rope-type yarn exports rope_parameters that give transformers' Llama our
    tables, and import reads back the same options."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_p2r.convert.hf.architecture import LLAMA
    from megatron_p2r.convert.hf.config_json import hf_config, model_values_from_hf

    m = _ours(case).model
    exported = hf_config(m, LLAMA, 64, "float32", {})
    hf = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 64, 64), torch.arange(64)[None])
    ours = model_rotary_tables(m, 64, "cpu")
    torch.testing.assert_close(cos[0], ours[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], ours[1], rtol=0, atol=1e-6)
    values = model_values_from_hf({**exported, "model_type": "llama"}, "config.json")[1]
    for name in (
        "rope_type",
        "rotary_scaling_factor",
        "mscale",
        "mscale_all_dim",
        "yarn_original_max_position_embeddings",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_correction_range_round_to_int",
    ):
        assert values[name] == pytest.approx(getattr(m, name)), name
