"""Reading HF config.json: the vocabulary padding chosen on import, the schema of the fields
import reads (a wrong type or range names the field instead of failing deep in the conversion),
and GPT2's GELU both ways."""

import pytest

from megatron_p2r.convert.hf.architecture import GPT2, HFConversionError
from megatron_p2r.convert.hf.config_json import hf_config, import_vocab_divisor, model_values_from_hf
from megatron_p2r.config import ModelConfig

MISTRAL = {
    "model_type": "mistral",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
    "vocab_size": 128,
}


def test_import_vocab_divisor_avoids_padding_when_tp_allows():
    assert import_vocab_divisor(208, 2) == 16 and import_vocab_divisor(201, 2) == 128


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(sliding_window="4096"), "sliding_window must be an integer in [1, 16777216], got '4096'"),
        (dict(sliding_window=0), "sliding_window must be an integer in [1, 16777216], got '0'"),
        (dict(use_sliding_window="yes"), "use_sliding_window must be true or false"),
        (dict(layer_types="sliding_attention"), "layer_types must be a list"),
        (dict(partial_rotary_factor=0.0), "partial_rotary_factor must be a number in (0, 1]"),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": "x"}),
            "rope_parameters.partial_rotary_factor must be a number in (0, 1]",
        ),
        (dict(num_key_value_heads=0), "num_key_value_heads must be an integer in [1, 4096]"),
    ],
)
def test_the_fields_of_grouped_query_and_sliding_window_models_are_checked(edit, message):
    with pytest.raises(HFConversionError) as err:
        model_values_from_hf({**MISTRAL, **edit}, "config.json")
    assert f"config.json: {message}" in str(err.value)


def test_a_valid_mistral_config_reads():
    arch, values = model_values_from_hf({**MISTRAL, "sliding_window": 32, "partial_rotary_factor": 1.0}, "config.json")
    assert values["num_query_groups"] == 2 and values["window_size"] == "31,0"


@pytest.mark.parametrize(
    "options,activation",
    [
        ({}, "gelu_new"),  # biases + bias-GELU fusion (the default): tanh
        ({"bias_gelu_fusion": False}, "gelu"),  # --no-bias-gelu-fusion: exact
        ({"disable_bias_linear": True}, "gelu"),  # no biases: exact (GPT2 gets zero biases)
    ],
)
def test_gpt2_activation_round_trips(options, activation):
    """Export names our GELU in transformers' terms; import reads it back as the same GELU."""
    ours = ModelConfig(vocab_size=200, **options)
    hf = hf_config(ours, GPT2, 256, "float32", {})
    assert hf["activation_function"] == activation
    _, values = model_values_from_hf(hf, "config.json")
    assert ModelConfig(**values).gelu_approximation == ours.gelu_approximation
