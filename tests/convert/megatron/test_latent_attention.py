"""Multi-latent attention and Megatron-LM checkpoints: not converted yet, refused by name both ways
(before anything is written), rather than converted wrongly. The project's own checkpoints carry
MLA (tests/p2r/test_latent_pseudo.py reshards and delinks them); Hugging Face's DeepSeek-V3 is
the interchange format for now (tests/convert/hf/test_deepseek_v3.py)."""

import pytest

from megatron_p2r.convert.megatron.args import MegatronConversionError, model_values
from megatron_p2r.convert.megatron.export_args import check_expressible
from tests.convert.megatron.test_args import LLAMA, saved
from tests.helpers import tiny_config
from tests.model.test_latent_attention import MLA


def test_a_megatron_mla_checkpoint_is_refused_by_name():
    with pytest.raises(MegatronConversionError, match=r"--multi-latent-attention True \(multi-latent attention"):
        model_values(saved(LLAMA, multi_latent_attention=True))


def test_export_of_an_mla_model_to_megatron_is_refused_by_name():
    with pytest.raises(MegatronConversionError, match="--multi-latent-attention \\(Megatron-LM's MLA tensors"):
        check_expressible(tiny_config(**MLA).model)
