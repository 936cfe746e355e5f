"""import-hf: models made by transformers import as the same function; what cannot be imported
is refused, naming the field or tensor."""
import json

import pytest
import torch
import transformers

from megatron_p2r.checkpoint.hf.architecture import HFConversionError
from megatron_p2r.checkpoint.hf.config_json import import_vocab_divisor
from megatron_p2r.checkpoint.hf.directory import SINGLE_FILE
from megatron_p2r.checkpoint.hf.importer import import_hf
from megatron_p2r.checkpoint.reshard import Target
from tests.checkpoint.hf.common import check_same_function, reference_model


def _hf_born(kind, directory, **extra):
    """A random tiny model made and saved by transformers itself."""
    t = transformers
    if kind == "gpt2":
        config = t.GPT2Config(vocab_size=201, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                              activation_function="gelu", **extra)
        model = t.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = t.LlamaConfig(vocab_size=201, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=16, attention_bias=True,
                               mlp_bias=True, tie_word_embeddings=False, **extra)
        model = t.LlamaForCausalLM(config)
    else:
        config = t.MixtralConfig(vocab_size=201, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                 num_experts_per_tok=2, max_position_embeddings=16, **extra)
        model = t.MixtralForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():  # larger than HF's init so that the logits are O(1)
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory))
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_import_models_made_by_transformers(kind, tmp_path):
    """A model transformers made (vocab 201, not a multiple of 8) imports as the same function:
    requested padding to 208 adds zero rows; logits on the 201 ids equal HF's."""
    theirs = _hf_born(kind, tmp_path / "hf")
    _, notes = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(2), make_vocab_size_divisible_by=8,
                            progress=False)
    assert any("padded from 201 to 208 rows with zeros" in n for n in notes)
    ours, cfg = reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (201, 208)
    check_same_function(ours, theirs, 201, 16, generate=False)  # (generation: see the export test)


def test_import_original_gpt2_layout_and_refusals(tmp_path):
    """Files without the ``transformer.`` prefix and with attention-mask buffers (as openai's
    gpt2) import; gelu_new needs --allow-approximate-gelu; GQA and unknown tensors are refused."""
    from safetensors.torch import load_file, save_file
    _hf_born("gpt2", tmp_path / "g")
    path = tmp_path / "g" / SINGLE_FILE
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    import_hf(str(tmp_path / "g"), str(tmp_path / "a"), Target(), progress=False)
    assert import_vocab_divisor(201, 1) == 1  # nothing padded when TP allows
    config = json.load(open(tmp_path / "g" / "config.json"))
    json.dump({**config, "activation_function": "gelu_new"}, open(tmp_path / "g" / "config.json", "w"))
    with pytest.raises(HFConversionError, match="--allow-approximate-gelu"):
        import_hf(str(tmp_path / "g"), str(tmp_path / "b"), Target(), progress=False)
    import_hf(str(tmp_path / "g"), str(tmp_path / "b"), Target(), allow_approximate_gelu=True, progress=False)
    tensors["h.0.mlp.extra.weight"] = torch.ones(2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="no place in our model, e.g. 'h.0.mlp.extra.weight'"):
        import_hf(str(tmp_path / "g"), str(tmp_path / "c"), Target(), allow_approximate_gelu=True, progress=False)
    transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        str(tmp_path / "gqa"))
    with pytest.raises(HFConversionError, match="grouped-query attention"):
        import_hf(str(tmp_path / "gqa"), str(tmp_path / "d"), Target(), progress=False)
