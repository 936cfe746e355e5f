"""DeepSeek-V3 (multi-latent attention, dense layers) through import-hf and export-hf (its MoE
layers and prediction layers: test_deepseek_v3_moe.py).

The fixture tests/fixtures/hf_deepseek_v3/tiny was written by transformers' own
DeepseekV3ForCausalLM (make_fixture.py beside it): query and key/value latents, YaRN factor 4 with
mscale_all_dim 0.8, interleaved rotary weights, value heads narrower than query/key heads. Imported
under TP 2 (the checkpoint's latent tensors split and replicated as the model holds them), our
one-process model's logits equal transformers' (fp32, <= 1e-5); exported back, every tensor is the
fixture's bit for bit and transformers loads it. A model without a query latent (q_proj) is made
by the same script at test time. What DeepSeek-V3 has and we do not read is refused by field.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_p2r.convert.hf.architecture import DEEPSEEK_V3, HFConversionError
from megatron_p2r.convert.hf.directory import SINGLE_FILE
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.reshard import Target
from tests.convert.hf.common import check_same_function, load_hf, reference_model
from tests.fixtures.hf_deepseek_v3.make_fixture import write

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "hf_deepseek_v3", "tiny")


def _round_trip(src, tmp_path, tp):
    import_hf(src, str(tmp_path / "ours"), Target(tp), make_vocab_size_divisible_by=8, progress=False)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    theirs = load_hf(src)
    check_same_function(ours, theirs, 201, 16, generate=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert result.architecture == DEEPSEEK_V3
    exported, original = load_file(str(tmp_path / "back" / SINGLE_FILE)), load_file(os.path.join(src, SINGLE_FILE))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    check_same_function(ours, load_hf(str(tmp_path / "back")), 201, 16, generate=False)
    return cfg.model


def test_fixture_imports_at_transformers_logits_and_exports_back_unchanged(tmp_path):
    m = _round_trip(FIXTURE, tmp_path, tp=2)
    assert m.multi_latent_attention and m.qk_layernorm
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (12, 8, 6, 8, 5)
    assert (m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) == (4.0, 1.0, 0.8)


def test_model_without_query_latent_round_trips(tmp_path):
    write(str(tmp_path / "hf"), q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    m = _round_trip(str(tmp_path / "hf"), tmp_path, tp=1)
    assert m.q_lora_rank is None and m.rotary_scaling_factor == 1.0 and m.rotary_base == 500.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_interleave": False}, "rope_interleave false"),
        ({"attention_bias": True}, "attention_bias true"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
            "rope_parameters.original_max_position_embeddings 8192: megatron-core's multi-latent attention fixes",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
            "rope_parameters.mscale_all_dim 1.0 without mscale",
        ),
    ],
)
def test_what_is_not_read_is_refused_by_field(tmp_path, change, message):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURE, src)
    config = json.load(open(src / "config.json"))
    json.dump({**config, **change}, open(src / "config.json", "w"))
    with pytest.raises(HFConversionError, match=message.replace("(", r"\(")):
        import_hf(str(src), str(tmp_path / "ours"), Target(1), progress=False)
