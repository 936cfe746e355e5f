"""import-hf: models made by transformers import as the same function; what cannot be imported
is refused, naming the field or tensor."""

import json

import pytest
import torch
import transformers

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.config_json import import_vocab_divisor
from megatron_p2r.convert.hf.directory import SINGLE_FILE
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.reshard import Target
from tests.convert.hf.common import check_same_function, reference_model


def _hf_config(kind, vocab_size=201, **extra):
    t, common = (
        transformers,
        dict(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
        ),
    )
    if kind.startswith("gpt2"):  # gpt2: exact GELU; gpt2_tanh: GPT-2's own tanh approximation
        return t.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=16,
            activation_function="gelu" if kind == "gpt2" else "gelu_new",
            **extra,
        )
    if kind == "llama":
        return t.LlamaConfig(
            **common, intermediate_size=48, attention_bias=True, mlp_bias=True, tie_word_embeddings=False, **extra
        )
    if kind == "llama_gqa":  # 2 key/value heads of 16 dimensions (4 x 16 = 64 query rows in hidden 32)
        return t.LlamaConfig(**common, intermediate_size=48, num_key_value_heads=2, head_dim=16, **extra)
    if kind == "mistral":  # one key/value head; a window of 8 < 16 positions
        return t.MistralConfig(**common, intermediate_size=48, num_key_value_heads=1, sliding_window=8, **extra)
    if kind == "qwen2":  # query/key/value biases only
        return t.Qwen2Config(**common, intermediate_size=48, num_key_value_heads=2, tie_word_embeddings=True, **extra)
    if kind == "qwen2_window":  # a window of 5 on layer 0, layer 1 full
        return t.Qwen2Config(
            **common,
            intermediate_size=48,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            **extra,
        )
    return t.MixtralConfig(
        **common, intermediate_size=24, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **extra
    )


def _hf_born(kind, directory, **extra):
    """A random tiny model made and saved by transformers itself."""
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, **extra))
    torch.manual_seed(0)
    with torch.no_grad():  # larger than HF's init so that the logits are O(1)
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory))
    return model.eval()


@pytest.mark.parametrize(
    "kind", ["gpt2", "gpt2_tanh", "llama", "llama_gqa", "mistral", "qwen2", "qwen2_window", "mixtral"]
)
def test_import_models_made_by_transformers(kind, tmp_path):
    """A model transformers made (vocab 201, not a multiple of 8) imports as the same function:
    requested padding to 208 adds zero rows; logits on the 201 ids equal HF's. Grouped-query
    models import under TP 2 (Mistral's one key/value head on both ranks). Sliding windows
    shorter than the 16 positions compared: Mistral's 8 on every layer becomes --window-size 7,0,
    Qwen2's 5 on layer 0 (layer 1 full) --window-size 4,0 --window-attn-skip-freq 2."""
    theirs = _hf_born(kind, tmp_path / "hf")
    _, notes = import_hf(
        str(tmp_path / "hf"), str(tmp_path / "ours"), Target(2), make_vocab_size_divisible_by=8, progress=False
    )
    assert any("padded from 201 to 208 rows with zeros" in n for n in notes)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    m = cfg.model
    assert (m.vocab_size, m.padded_vocab_size) == (201, 208)
    expected = {
        "llama_gqa": (2, 16),
        "mistral": (1, 8),
        "qwen2": (2, 8),
        "qwen2_window": (2, 8),
        "mixtral": (2, 8),
    }.get(kind, (4, 8))
    assert (m.query_groups, m.head_dim) == expected and m.group_query_attention == (
        kind not in ("gpt2", "gpt2_tanh", "llama")
    )
    assert m.gelu_approximation == ("tanh" if kind == "gpt2_tanh" else "none")
    assert m.max_positions == 16
    window = {"mistral": ("7,0", None), "qwen2_window": ("4,0", 2)}.get(kind, (None, None))
    assert (m.window_size, m.window_attn_skip_freq) == window
    if kind == "mistral":
        assert any("sliding_window 8: --window-size 7,0" in n for n in notes)
    if kind.startswith("qwen2"):
        assert m.add_qkv_bias and m.disable_bias_linear
    check_same_function(ours, theirs, 201, m.max_positions, generate=False)  # (generation: see the export test)


def test_import_original_gpt2_layout_and_refusals(tmp_path):
    """Files without the ``transformer.`` prefix and with attention-mask buffers (as openai's
    gpt2) import; an activation other than GELU and unknown tensors are refused."""
    from safetensors.torch import load_file, save_file

    _hf_born("gpt2", tmp_path / "g")
    path = tmp_path / "g" / SINGLE_FILE
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    import_hf(str(tmp_path / "g"), str(tmp_path / "a"), Target(), progress=False)
    assert import_vocab_divisor(201, 1) == 1  # nothing padded when TP allows
    config = json.load(open(tmp_path / "g" / "config.json"))
    json.dump({**config, "activation_function": "relu"}, open(tmp_path / "g" / "config.json", "w"))
    with pytest.raises(
        HFConversionError,
        match=r"config.json: activation_function 'relu' has no equivalent here "
        r"\(GELU: one of \['gelu', 'gelu_accurate'",
    ):
        import_hf(str(tmp_path / "g"), str(tmp_path / "b"), Target(), progress=False)
    json.dump(config, open(tmp_path / "g" / "config.json", "w"))
    tensors["h.0.mlp.extra.weight"] = torch.ones(2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="no place in our model, e.g. 'h.0.mlp.extra.weight'"):
        import_hf(str(tmp_path / "g"), str(tmp_path / "c"), Target(), progress=False)
    _hf_born(
        "llama",
        tmp_path / "partial",
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    with pytest.raises(HFConversionError, match="partial_rotary_factor 0.5"):
        import_hf(str(tmp_path / "partial"), str(tmp_path / "d"), Target(), progress=False)
    config = json.load(open(tmp_path / "partial" / "config.json"))
    json.dump({**config, "model_type": "falcon"}, open(tmp_path / "partial" / "config.json", "w"))
    with pytest.raises(HFConversionError, match="model_type 'falcon' is not supported; import reads"):
        import_hf(str(tmp_path / "partial"), str(tmp_path / "e"), Target(), progress=False)


def test_tokenizer_json_configures_huggingface_tokenizer(tmp_path):
    """A directory with a tokenizer.json (fewer tokens than the 336 embedding rows) imports with
    --tokenizer-type HuggingFaceTokenizer pointing at the copied files; the divisor pads the
    tokenizer's vocabulary back to exactly the model's rows (training takes the size from it)."""
    from megatron_p2r.arguments import config_from_values, load_yaml
    from megatron_p2r.data.tokenizers import build_tokenizer
    from megatron_p2r.training import resolve_vocab
    from tests.data.test_hf_tokenizer import LLAMA3_CONFIG, write_tokenizer

    _hf_born("llama_gqa", tmp_path / "hf", vocab_size=336)
    write_tokenizer(tmp_path / "hf", LLAMA3_CONFIG)
    _, notes = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(2), progress=False)
    assert notes[0].startswith("tokenizer: HuggingFaceTokenizer (tokenizer.json, tokenizer_config.json)")
    values = load_yaml(str(tmp_path / "ours" / "model.yaml"))
    assert values["tokenizer_type"] == "HuggingFaceTokenizer"
    assert values["tokenizer_model"] == str(tmp_path / "ours" / "tokenizer")
    cfg = resolve_vocab(config_from_values({**values, "mock_data": True}))
    tokenizer = build_tokenizer(cfg.data)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (tokenizer.vocab_size, 336)
    assert tokenizer.vocab_size < 336 - 16  # not a plain power-of-two padding
    # rows the tokenizer cannot be padded to under TP 2: not configured, and said why
    _hf_born("llama_gqa", tmp_path / "odd", vocab_size=337)
    write_tokenizer(tmp_path / "odd", LLAMA3_CONFIG)
    _, notes = import_hf(str(tmp_path / "odd"), str(tmp_path / "odd_ours"), Target(2), progress=False)
    assert "cannot be padded to the model's 337 embedding rows under TP 2" in notes[0]
    assert "tokenizer_type" not in load_yaml(str(tmp_path / "odd_ours" / "model.yaml"))
