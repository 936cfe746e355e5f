"""Multi-latent attention and Megatron-LM checkpoints. Import: Megatron's MLA args become ours
(Megatron-LM's defaults where missing); the Megatron-written fixtures mla_legacy_tp2 and
mla_dist_tp2 (tests/fixtures/megatron, megatron-core's own MLASelfAttention) import at Megatron's
logits in tests/convert/megatron/test_megatron_written.py. Export: our MLA args read back as
ours; the tensors round-trip and load in Megatron in test_export.py and
test_export_megatron_core.py (model "deepseek")."""

import pytest

from megatron_p2r.convert.megatron.args import MegatronConversionError, model_values
from megatron_p2r.convert.megatron.export_args import MegatronLayout, megatron_args
from tests.convert.megatron.test_args import LLAMA, saved
from tests.helpers import tiny_config
from tests.model.test_latent_attention import MLA


def test_megatrons_mla_args_are_ours():
    values, _, _ = model_values(saved(LLAMA, multi_latent_attention=True, q_lora_rank=12, mscale_all_dim=0.8))
    assert values["multi_latent_attention"] and values["q_lora_rank"] == 12 and values["mscale_all_dim"] == 0.8
    assert (values["kv_lora_rank"], values["qk_head_dim"], values["qk_pos_emb_head_dim"], values["v_head_dim"]) == (
        32,
        128,
        64,
        128,
    )  # Megatron-LM's defaults
    assert "kv_channels" not in values
    with pytest.raises(MegatronConversionError, match="--rope-type rope with --rotary-scaling-factor 4.0"):
        model_values(saved(LLAMA, multi_latent_attention=True, rope_type="rope", rotary_scaling_factor=4.0))


def test_our_mla_args_read_back_as_ours():
    """The args export-megatron writes for an MLA model (YaRN, no query latent too) are read back
    by the importer as the same model: the export's own round-trip check passes."""
    for options in (MLA, dict(MLA, q_lora_rank=None)):
        cfg = tiny_config(**options, position_embedding_type="rope")
        args = megatron_args(
            cfg, MegatronLayout(1, 1, 1, "torch_dist"), iteration=0, consumed_samples=0, dtype="float32"
        )
        assert args.multi_latent_attention and args.rope_type == "yarn" and args.q_lora_rank == options["q_lora_rank"]
