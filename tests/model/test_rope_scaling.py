"""Rotary scaling with Megatron-LM's flags: --use-rope-scaling/--rope-scaling-factor (Llama 3.1)
and --rotary-seq-len-interpolation-factor give the angles megatron-core 0.16.1's own
RotaryEmbedding gives (tests/fixtures/megatron_rope, written by megatron-core)."""

import json
import os

import pytest
import torch

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from megatron_p2r.model.attention import model_rotary_tables

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron_rope")
with open(os.path.join(HERE, "rope.json"), encoding="utf-8") as fh:
    FIXTURE = json.load(fh)
BASE = [
    "--mock-data",
    "--vocab-size",
    "64",
    "--num-layers",
    "1",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--position-embedding-type",
    "rope",
    "--seq-length",
    str(FIXTURE["seq_length"]),
]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda case: " ".join(case["flags"]))
def test_rotary_angles_are_megatrons(case):
    cfg = parse_args(BASE + case["flags"])
    cos, sin = model_rotary_tables(cfg.model, cfg.model.seq_length, "cpu")
    freqs = torch.tensor(case["freqs"])
    want = torch.cat([freqs, freqs], dim=-1)
    torch.testing.assert_close(cos, want.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want.sin(), rtol=0, atol=1e-6)


def test_scaling_needs_rotary_positions():
    for flags in (["--use-rope-scaling"], ["--rotary-seq-len-interpolation-factor", "2"]):
        cfg = parse_args(BASE[:-4] + flags)
        with pytest.raises(ConfigError, match=f"{flags[0]} scales rotary embeddings: it needs --position-embedding"):
            validate(cfg, 1)


@pytest.mark.parametrize(
    "flags, kind",
    [
        (["--use-rope-scaling", "--rope-scaling-factor", "32"], "llama3"),
        (["--rotary-seq-len-interpolation-factor", "4"], "linear"),
    ],
)
def test_hf_export_carries_the_scaling_and_import_reads_it(flags, kind):
    """The exported config.json gives transformers' Llama the same rotary tables (its own rope
    code), and importing it gives back the flags."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_p2r.convert.hf.architecture import LLAMA
    from megatron_p2r.convert.hf.config_json import hf_config, model_values_from_hf

    cfg = parse_args(
        BASE
        + [
            "--kv-channels",
            "64",
            "--rotary-base",
            "500000",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--seq-length",
            "64",
        ]
        + flags
    )
    exported = hf_config(cfg.model, LLAMA, 64, "float32", {})
    assert exported["rope_parameters"]["rope_type"] == kind
    hf = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    rope = LlamaRotaryEmbedding(hf)
    positions = torch.arange(64)[None]
    cos, sin = rope(torch.zeros(1, 64, 64), positions)
    ours = model_rotary_tables(cfg.model, 64, "cpu")
    torch.testing.assert_close(cos[0], ours[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[0], ours[1], rtol=0, atol=1e-5)
    values = model_values_from_hf({**exported, "model_type": "llama"}, "config.json")[1]
    back = {
        k: values.get(k) for k in ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor")
    }
    m = cfg.model
    assert back == {
        "use_rope_scaling": m.use_rope_scaling or None,
        "rope_scaling_factor": m.rope_scaling_factor if m.use_rope_scaling else None,
        "rotary_seq_len_interpolation_factor": m.rotary_seq_len_interpolation_factor,
    }


def test_local_base_tables_are_unscaled_as_gemma3s_sliding_layers():
    """With --rotary-base-local the scaling flags reach the full layers' tables only: the full
    tables are transformers' Gemma 3 full_attention (linear by 8 over 10^6), the local ones its
    default sliding_attention (10^4), as every released Gemma 3 from 4B up."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    flags = ["--rotary-base", "1000000", "--rotary-base-local", "10000", "--rotary-seq-len-interpolation-factor", "8"]
    cfg = parse_args(BASE[:-2] + ["--seq-length", "64", "--window-size", "4,0"] + flags)
    validate(cfg, 1)
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    hf = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
    theirs = Gemma3RotaryEmbedding(hf)
    ours = model_rotary_tables(cfg.model, 64, "cpu")
    for kind, (cos, sin) in (("full_attention", ours[:2]), ("sliding_attention", ours[2:])):
        want_cos, want_sin = theirs(torch.zeros(1, 64, 16), torch.arange(64)[None], kind)
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)
