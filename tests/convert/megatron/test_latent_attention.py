"""Multi-latent attention and Megatron-LM checkpoints. Import: Megatron's MLA args become ours
(Megatron-LM's defaults where missing); the Megatron-written fixtures mla_legacy_tp2 and
mla_dist_tp2 (tests/fixtures/megatron, megatron-core's own MLASelfAttention) import at Megatron's
logits in tests/convert/megatron/test_megatron_written.py. Export to Megatron is refused by name,
before anything is written."""

import pytest

from megatron_p2r.convert.megatron.args import MegatronConversionError, model_values
from megatron_p2r.convert.megatron.export_args import check_expressible
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


def test_export_of_an_mla_model_to_megatron_is_refused_by_name():
    with pytest.raises(MegatronConversionError, match="--multi-latent-attention \\(export to Megatron-LM's MLA"):
        check_expressible(tiny_config(**MLA).model)
