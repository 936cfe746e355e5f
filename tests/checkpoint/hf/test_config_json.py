"""HF config.json: the vocabulary padding chosen on import; GPT2's GELU both ways."""
import pytest

from megatron_p2r.checkpoint.hf.architecture import GPT2
from megatron_p2r.checkpoint.hf.config_json import hf_config, import_vocab_divisor, model_values_from_hf
from megatron_p2r.config import ModelConfig


def test_import_vocab_divisor_avoids_padding_when_tp_allows():
    assert import_vocab_divisor(208, 2) == 16 and import_vocab_divisor(201, 2) == 128


@pytest.mark.parametrize("options,activation", [
    ({}, "gelu_new"),                                  # biases + bias-GELU fusion (the default): tanh
    ({"bias_gelu_fusion": False}, "gelu"),             # --no-bias-gelu-fusion: exact
    ({"disable_bias_linear": True}, "gelu"),           # no biases: exact (GPT2 gets zero biases)
])
def test_gpt2_activation_round_trips(options, activation):
    """Export names our GELU in transformers' terms; import reads it back as the same GELU."""
    ours = ModelConfig(vocab_size=200, **options)
    hf = hf_config(ours, GPT2, 256, "float32", {})
    assert hf["activation_function"] == activation
    _, values = model_values_from_hf(hf, "config.json")
    assert ModelConfig(**values).gelu_approximation == ours.gelu_approximation
