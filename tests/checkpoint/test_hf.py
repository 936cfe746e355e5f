"""Export to Hugging Face transformers and import back (megatron_p2r/checkpoint/hf.py, docs/hf.md).

The end-to-end test trains one tiny model per HF target on 4 gloo ranks — GPT2 under TP=2 x
PP=2, Llama in the pseudo phase under TP=2 x PP=2 (so export delinks on the fly), Mixtral under
TP=2 x EP=2 — saves it with --save, exports it, loads it with
``AutoModelForCausalLM.from_pretrained`` and compares with our one-process model built from
the same checkpoint by the checkpoint engineer's converter and loader (independent of hf.py):

- logits on random token ids, fp32: ``assert_close(rtol=1e-5, atol=1e-5)`` (the two differ
  only in reduction order; observed ~1e-7);
- greedy generation of 10 tokens (our loop re-runs the full sequence each step) equal;
- import-hf of the export into another layout gives the same eval loss as the original
  checkpoint in its own layout (rel. 1e-5), loaded with the flags of the written model.yaml;
- the tokenizer files load with AutoTokenizer and encode as our tokenizers do.
"""
import json
import os

import pytest
import torch

from megatron_p2r.arguments import config_from_values, load_yaml
from megatron_p2r.checkpoint import hf
from megatron_p2r.checkpoint.format import metadata_config, read_metadata, resolve_iteration_dir
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.reshard import DelinkOptions, Target, convert
from megatron_p2r.config import ModelConfig
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.testing import run_distributed
from tests.data.test_tokenizers import SAMPLES, TRAIN_TEXTS
from tests.helpers import TINY, run_steps, tiny_config
from tools.convert_checkpoint import main
import transformers  # noqa: E402  (the [hf] extra; part of [test])

TOL = dict(rtol=1e-5, atol=1e-5)   # fp32 logits, same weights: reduction order only
# eval at the last step: the loss of the saved weights, compared with the imported copy's
COMMON = dict(train_iters=3, global_batch_size=4, eval_interval=3, eval_iters=2, device="cpu", log_interval=100)
ROPE = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
CASES = {
    # learned positions + LayerNorm + GELU, tied, biases -> GPT2LMHeadModel
    "gpt2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    # rotary + RMSNorm + SwiGLU, untied, biases, pseudo phase (share all) -> LlamaForCausalLM
    "llama": dict(ROPE, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4,
                  p2r_phase="pseudo", share_pattern="all", untie_embeddings_and_output_weights=True,
                  make_vocab_size_divisible_by=128),
    # top-2 MoE in every layer -> MixtralForCausalLM
    "mixtral": dict(ROPE, tensor_model_parallel_size=2, expert_model_parallel_size=2, num_experts=4,
                    moe_router_topk=2, moe_renormalize_topk=True, moe_ffn_hidden_size=24,
                    disable_bias_linear=True, moe_aux_loss_coeff=0.01),
}
# Import each export into a different layout (4 ranks each).
IMPORT_LAYOUTS = {"gpt2": Target(4, 1), "llama": Target(1, 2, "3,1"), "mixtral": Target(1, 2, None, 2)}


def _bpe_files(directory):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TRAIN_TEXTS, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _sp_model(directory):
    import sentencepiece
    lines = [line for text in TRAIN_TEXTS for line in text.split("\n") if line.strip()]
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2, num_threads=1)
    return str(directory / "sp.model")


def _train(rank, world, root, cases):
    """Train and save each case; return its eval loss after the last step."""
    from megatron_p2r.training import pretrain
    return {name: pretrain(config_from_values({**TINY, **COMMON, **values, "save": os.path.join(root, name)}))
            ["eval_losses"][-1] for name, values in cases.items()}


def _eval_losses(rank, world, runs):
    from megatron_p2r.training import pretrain
    return {name: pretrain(config_from_values(values))["eval_loss"] for name, values in runs.items()}


def reference_model(src, tmp):
    """Our one-process model with SRC's weights, via reshard/delink + load_checkpoint (not hf.py)."""
    from megatron_p2r.training import build_train_state
    meta = read_metadata(resolve_iteration_dir(src))
    pseudo = meta["p2r"]["phase"] == "pseudo"
    convert(src, tmp, Target(1, 1, None, 1), DelinkOptions() if pseudo else None, progress=False)
    cfg = metadata_config(read_metadata(resolve_iteration_dir(tmp)))
    state = build_train_state(cfg, ParallelState.single())
    load_checkpoint(tmp, state, finetune=True)
    return state.model.eval(), cfg


def greedy(model, prompt, steps=10):
    """Our greedy decoding: the whole sequence again at each step, argmax of the last logits."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(tokens=ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def load_hf(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.generation_config.eos_token_id = None  # generate exactly 10 tokens, as our loop does
    model.generation_config.pad_token_id = 0
    return model.eval()


def check_same_function(ours, theirs, vocab, seq, seed=0, generate=True):
    """Logits on random ids, and 10 greedy tokens from a 6-token prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    with torch.no_grad():
        a, b = ours(tokens=ids), theirs(input_ids=ids).logits
    assert a.abs().max() > 0.5  # trained enough for the comparison to mean something
    torch.testing.assert_close(b, a[..., :b.shape[-1]], **TOL)
    if not generate:
        return
    prompt = ids[:, :6]
    with torch.no_grad():
        hf_ids = theirs.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(hf_ids, greedy(ours, prompt))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The three cases trained 3 steps on 4 ranks and saved; tokenizers for GPT2 and Llama."""
    root = tmp_path_factory.mktemp("hf")
    (root / "bpe").mkdir()
    vocab, merges = _bpe_files(root / "bpe")
    cases = {k: dict(v) for k, v in CASES.items()}
    cases["gpt2"].update(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    cases["llama"].update(tokenizer_type="SentencePieceTokenizer", tokenizer_model=_sp_model(root))
    losses = run_distributed(_train, 4, str(root), cases, timeout=300)[0]
    return root, cases, losses


def test_export_load_generate_import_eval(trained):
    """Every target: transformers' logits and greedy tokens equal ours; import into another
    layout keeps the eval loss."""
    root, cases, trained_losses = trained
    import_runs = {}
    for name, values in cases.items():
        src, dst = str(root / name), str(root / f"{name}_hf")
        # Llama is written in several files with an index (the sharded path through transformers).
        result = hf.export_hf(src, dst, progress=False, max_shard_size="64KB" if name == "llama" else "5GB")
        assert result.architecture == {"gpt2": hf.GPT2, "llama": hf.LLAMA, "mixtral": hf.MIXTRAL}[name]
        assert (len(result.files) > 1) == (name == "llama") == os.path.isfile(os.path.join(dst, hf.INDEX_FILE))
        ours, cfg = reference_model(src, str(root / f"{name}_single"))
        theirs = load_hf(dst)
        assert type(theirs).__name__ == result.architecture
        assert theirs.config.vocab_size == cfg.model.padded_vocab_size  # padding kept by default
        check_same_function(ours, theirs, cfg.model.vocab_size, cfg.model.seq_length)
        if cfg.data.tokenizer_type:
            from megatron_p2r.data.tokenizers import build_tokenizer
            tok, ref = transformers.AutoTokenizer.from_pretrained(dst), build_tokenizer(cfg.data)
            for text in SAMPLES.values():
                assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text
        else:
            assert "tokenizer not copied" in result.notes[0]

        back = str(root / f"{name}_back")
        hf.import_hf(dst, back, IMPORT_LAYOUTS[name], progress=False)
        common = dict(eval_only=True, mock_data=True, seed=TINY["seed"], micro_batch_size=2, global_batch_size=4,
                      eval_iters=2, device="cpu", log_interval=100)
        yaml_values = load_yaml(os.path.join(back, "model.yaml"))
        assert yaml_values["tensor_model_parallel_size"] == IMPORT_LAYOUTS[name].tensor_parallel_size
        if not cfg.data.tokenizer_type:
            yaml_values["vocab_size"] = cfg.model.vocab_size  # the mock data's token range
        import_runs[name] = {**yaml_values, "load": back, **common}
    losses = run_distributed(_eval_losses, 4, import_runs, timeout=300)[0]
    for name in cases:
        assert losses[name] == pytest.approx(trained_losses[name], rel=1e-5), name


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One-process GPT2-like checkpoint (2 steps) for the option and CLI tests."""
    root = tmp_path_factory.mktemp("hf_small")
    _, state = run_steps(tiny_config(), ParallelState.single(), 2)
    save_checkpoint(str(root / "ckpt"), state)
    return root


def test_trim_vocab_and_bf16(small, tmp_path):
    """--trim-vocab: vocab_size is the tokenizer's, logits on those ids unchanged; --dtype bfloat16
    writes bf16 tensors whose fp32 values are our weights rounded."""
    src = str(small / "ckpt")
    result = hf.export_hf(src, str(tmp_path / "t"), trim_vocab=True, dtype="bfloat16", progress=False)
    config = json.load(open(tmp_path / "t" / "config.json"))
    assert (result.vocab_size, config["vocab_size"], config["dtype"]) == (200, 200, "bfloat16")
    assert hf.verify_export(src, str(tmp_path / "t")) < 1e-5
    from safetensors import safe_open
    with safe_open(str(tmp_path / "t" / hf.SINGLE_FILE), "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
        assert f.get_tensor("transformer.wte.weight").shape == (200, 32)


def test_cli_export_verify_and_import(small, tmp_path, capsys):
    src = str(small / "ckpt")
    assert main(["export-hf", src, str(tmp_path / "h"), "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wrote GPT2LMHeadModel" in out and "verified" in out and "vocabulary kept padded: 208 rows" in out
    assert main(["export-hf", src, str(tmp_path / "h"), "--no-progress"]) == 2  # DST not empty, no --force
    assert "--force" in capsys.readouterr().err
    assert main(["import-hf", str(tmp_path / "h"), str(tmp_path / "c"), "--target-tensor-parallel-size", "2",
                 "--no-progress"]) == 0
    meta = read_metadata(resolve_iteration_dir(str(tmp_path / "c")))
    assert meta["layout"]["tp"] == 2 and meta["history"][0]["op"] == "import-hf" and not meta["optimizer"]
    assert main(["inspect", str(tmp_path / "c")]) == 0


@pytest.mark.parametrize("values, arch, blocked", [
    (dict(ROPE, normalization="LayerNorm"), "LlamaForCausalLM", "--normalization LayerNorm"),
    (dict(ROPE, swiglu=False), "LlamaForCausalLM", "no --swiglu"),
    (dict(normalization="RMSNorm"), "GPT2LMHeadModel", "--normalization RMSNorm"),
    (dict(swiglu=True), "GPT2LMHeadModel", "--swiglu"),
    (dict(ROPE, num_experts=4, moe_renormalize_topk=True, disable_bias_linear=True, moe_layer_freq=2),
     "MixtralForCausalLM", "--moe-layer-freq 2"),
    (dict(ROPE, num_experts=4, moe_renormalize_topk=True, disable_bias_linear=True, moe_num_prototypes=2),
     "MixtralForCausalLM", "--moe-num-prototypes 2"),
    (dict(ROPE, num_experts=4, disable_bias_linear=True), "MixtralForCausalLM", "no --moe-renormalize-topk"),
    (dict(ROPE, num_experts=4, moe_renormalize_topk=True), "MixtralForCausalLM", "biases in linear layers"),
    (dict(ROPE, num_experts=4, moe_renormalize_topk=True, disable_bias_linear=True, moe_capacity_factor=1.0),
     "MixtralForCausalLM", "--moe-capacity-factor 1.0"),
    (dict(num_experts=4, moe_renormalize_topk=True, disable_bias_linear=True), "MixtralForCausalLM",
     "--position-embedding-type learned_absolute"),
])
def test_inexpressible_configs_name_the_option(values, arch, blocked):
    with pytest.raises(hf.HFConversionError, match="cannot express") as exc:
        hf.hf_architecture(ModelConfig(**values))
    assert arch in str(exc.value) and blocked in str(exc.value)


def test_inexpressible_checkpoint_fails_in_cli(tmp_path, capsys):
    """LayerNorm + SwiGLU + rotary: export-hf exits 2 naming --normalization, writes nothing."""
    _, state = run_steps(tiny_config(**dict(ROPE, normalization="LayerNorm")), ParallelState.single(), 1)
    save_checkpoint(str(tmp_path / "ln"), state)
    assert main(["export-hf", str(tmp_path / "ln"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM" in err and "--normalization LayerNorm (Llama uses RMSNorm)" in err
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(str(tmp_path / "out") + ".tmp")


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
    _, notes = hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), Target(2), make_vocab_size_divisible_by=8,
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
    path = tmp_path / "g" / hf.SINGLE_FILE
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    hf.import_hf(str(tmp_path / "g"), str(tmp_path / "a"), Target(), progress=False)
    assert hf.import_vocab_divisor(201, 1) == 1  # nothing padded when TP allows
    config = json.load(open(tmp_path / "g" / "config.json"))
    json.dump({**config, "activation_function": "gelu_new"}, open(tmp_path / "g" / "config.json", "w"))
    with pytest.raises(hf.HFConversionError, match="--allow-approximate-gelu"):
        hf.import_hf(str(tmp_path / "g"), str(tmp_path / "b"), Target(), progress=False)
    hf.import_hf(str(tmp_path / "g"), str(tmp_path / "b"), Target(), allow_approximate_gelu=True, progress=False)
    tensors["h.0.mlp.extra.weight"] = torch.ones(2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(hf.HFConversionError, match="no place in our model, e.g. 'h.0.mlp.extra.weight'"):
        hf.import_hf(str(tmp_path / "g"), str(tmp_path / "c"), Target(), allow_approximate_gelu=True, progress=False)
    transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        str(tmp_path / "gqa"))
    with pytest.raises(hf.HFConversionError, match="grouped-query attention"):
        hf.import_hf(str(tmp_path / "gqa"), str(tmp_path / "d"), Target(), progress=False)


def test_pure_mappings_round_trip():
    """split/merge of QKV and SwiGLU rows are inverse, and follow the documented layouts."""
    heads, hd, h = 2, 3, 5
    w = torch.arange(heads * 3 * hd * h, dtype=torch.float32).view(heads * 3 * hd, h)
    q, k, v = hf.split_qkv(w, heads)
    assert torch.equal(q[hd:2 * hd], w[3 * hd:4 * hd])  # head 1's q rows follow head 0's v rows
    assert torch.equal(hf.merge_qkv(q, k, v, heads), w)
    gate, up = hf.split_glu(w)
    assert torch.equal(gate[1], w[2]) and torch.equal(up[1], w[3])
    assert torch.equal(hf.merge_glu(gate, up), w)
    assert hf.import_vocab_divisor(208, 2) == 16 and hf.import_vocab_divisor(201, 2) == 128
    assert hf.parse_size("64KB") == 64000 and hf.parse_size("2MiB") == 2 ** 21
    assert hf.plan_shards([[("a", "F32", (10,))], [("b", "F32", (10,))], [("c", "F32", (30,))]], 80) == [[0, 1], [2]]


def test_export_without_transformers(small, tmp_path):
    """transformers blocked from importing: export-hf writes the files; only --verify fails, naming the extra."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from tools.convert_checkpoint import main\n"
            f"sys.exit(main(['export-hf', {str(small / 'ckpt')!r}, {str(tmp_path / 'x')!r}, '--verify', "
            "'--no-progress']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 2, proc.stderr
    assert "verification needs transformers: pip install 'megatron_p2r[hf]'" in proc.stderr
    assert sorted(os.listdir(tmp_path / "x")) == ["config.json", "model.safetensors"]
