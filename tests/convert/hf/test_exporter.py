"""Export to Hugging Face transformers and import back (megatron_p2r/convert/hf/, docs/hf.md).

The end-to-end test trains one tiny model per HF target on 4 gloo ranks — GPT2 under TP=2 x
PP=2, Llama with grouped-query attention in the pseudo phase under TP=2 x PP=2 (so export
delinks on the fly), Mistral with one key/value head replicated over TP=2 and a tokenizer.json, Mixtral (GQA, top-2)
under TP=2 x EP=2, Qwen2 (QKV biases only, --kv-channels) under TP=2 — saves
it with --save, exports it, loads it with
``AutoModelForCausalLM.from_pretrained`` and compares with our one-process model built from
the same checkpoint by the checkpoint engineer's converter and loader (independent of convert/hf/):

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
from megatron_p2r.convert.hf.architecture import GPT2, LLAMA, MISTRAL, MIXTRAL, QWEN2
from megatron_p2r.convert.hf.directory import INDEX_FILE, SINGLE_FILE
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.hf.verify import verify_export
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.convert.reshard import Target
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.convert.hf.common import GQA, ROPE, check_same_function, load_hf, reference_model
from tests.data.test_hf_tokenizer import LLAMA3_CONFIG, write_tokenizer
from tests.data.test_tokenizers import SAMPLES, TRAIN_TEXTS
from tests.helpers import TINY, run_steps, tiny_config
from tests.reliability.common import ROOT
from tools.convert_checkpoint import main
import transformers  # noqa: E402  (the [hf] extra; part of [test])

# eval at the last step: the loss of the saved weights, compared with the imported copy's
COMMON = dict(train_iters=3, global_batch_size=4, eval_interval=3, eval_iters=2, device="cpu", log_interval=100)
CASES = {
    # learned positions + LayerNorm + GELU, tied, biases -> GPT2LMHeadModel
    "gpt2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    # rotary + RMSNorm + SwiGLU, untied, biases, 2 key/value groups, pseudo phase (share all), Llama 3.1's rotary
    # scaling -> LlamaForCausalLM (rope_type llama3)
    "llama": dict(
        ROPE,
        **GQA,
        num_query_groups=2,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="all",
        untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=128,
        use_rope_scaling=True,
        rope_scaling_factor=4.0,
    ),
    # one key/value head (replicated over TP 2), no biases, a 6-token window, positions interpolated by 2
    # -> MistralForCausalLM (sliding_window 6, rope_type linear)
    "mistral": dict(
        ROPE,
        **GQA,
        num_query_groups=1,
        tensor_model_parallel_size=2,
        disable_bias_linear=True,
        window_size="5,0",
        rotary_seq_len_interpolation_factor=2,
    ),
    # top-2 MoE in every layer, 2 key/value groups -> MixtralForCausalLM
    "mixtral": dict(
        ROPE,
        **GQA,
        num_query_groups=2,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_experts=4,
        moe_router_topk=2,
        moe_router_pre_softmax=False,
        moe_ffn_hidden_size=24,
        disable_bias_linear=True,
        moe_aux_loss_coeff=0.01,
    ),
    # biases on the query/key/value projections only, heads of 16 in hidden 32, a window on layer 0 only
    # -> Qwen2ForCausalLM (layer_types sliding, full)
    "qwen2": dict(
        ROPE,
        **GQA,
        num_query_groups=2,
        kv_channels=16,
        tensor_model_parallel_size=2,
        disable_bias_linear=True,
        add_qkv_bias=True,
        window_size="3,0",
        window_attn_skip_freq=2,
    ),
}
ARCHITECTURES = {"gpt2": GPT2, "llama": LLAMA, "mistral": MISTRAL, "mixtral": MIXTRAL, "qwen2": QWEN2}
# Import each export into a different layout (4 ranks each); Mistral's key/value head on 4 TP ranks.
IMPORT_LAYOUTS = {
    "gpt2": Target(4, 1),
    "llama": Target(1, 2, "3,1"),
    "mistral": Target(4),
    "mixtral": Target(1, 2, None, 2),
    "qwen2": Target(2, 2),
}


def _bpe_files(directory):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        TRAIN_TEXTS, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _sp_model(directory):
    import sentencepiece

    lines = [line for text in TRAIN_TEXTS for line in text.split("\n") if line.strip()]
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_prefix=str(directory / "sp"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
        num_threads=1,
    )
    return str(directory / "sp.model")


def _train(rank, world, root, cases):
    """Train and save each case; return its eval loss after the last step."""
    from megatron_p2r.training import pretrain

    return {
        name: pretrain(config_from_values({**TINY, **COMMON, **values, "save": os.path.join(root, name)}))[
            "eval_losses"
        ][-1]
        for name, values in cases.items()
    }


def _eval_losses(rank, world, runs):
    from megatron_p2r.training import pretrain

    return {name: pretrain(config_from_values(values))["eval_loss"] for name, values in runs.items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The cases trained 3 steps on 4 ranks and saved; tokenizers for GPT2, Llama and Mistral (a
    tokenizer.json: transformers 5 would load it with Qwen2's own pre-tokenizer in a Qwen2
    directory, docs/hf.md)."""
    root = tmp_path_factory.mktemp("hf")
    (root / "bpe").mkdir()
    vocab, merges = _bpe_files(root / "bpe")
    cases = {k: dict(v) for k, v in CASES.items()}
    cases["gpt2"].update(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    cases["llama"].update(tokenizer_type="SentencePieceTokenizer", tokenizer_model=_sp_model(root))
    cases["mistral"].update(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(write_tokenizer(root / "hf_tok", LLAMA3_CONFIG))
    )
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
        result = export_hf(
            src,
            dst,
            progress=False,
            max_shard_size="64KB" if name == "llama" else "5GB",
            architecture=MISTRAL if name == "mistral" else None,
        )
        assert result.architecture == ARCHITECTURES[name]
        assert (len(result.files) > 1) == (name == "llama") == os.path.isfile(os.path.join(dst, INDEX_FILE))
        ours, cfg = reference_model(src, str(root / f"{name}_single"))
        theirs = load_hf(dst)
        assert type(theirs).__name__ == result.architecture
        assert theirs.config.vocab_size == cfg.model.padded_vocab_size  # padding kept by default
        assert getattr(theirs.config, "sliding_window", None) == {"mistral": 6, "qwen2": 4}.get(name)
        check_same_function(ours, theirs, cfg.model.vocab_size, cfg.model.seq_length)
        if cfg.data.tokenizer_type:
            from megatron_p2r.data.tokenizers import build_tokenizer

            tok, ref = transformers.AutoTokenizer.from_pretrained(dst), build_tokenizer(cfg.data)
            hf_specials = cfg.data.tokenizer_type == "HuggingFaceTokenizer"  # bos from tokenizer.json's template
            for text in SAMPLES.values():
                assert tok.encode(text, add_special_tokens=hf_specials) == ref.encode(text), text
        else:
            assert "tokenizer not copied" in result.notes[0]

        back = str(root / f"{name}_back")
        import_hf(dst, back, IMPORT_LAYOUTS[name], progress=False)
        common = dict(
            eval_only=True,
            mock_data=True,
            seed=TINY["seed"],
            micro_batch_size=2,
            global_batch_size=4,
            eval_iters=2,
            device="cpu",
            log_interval=100,
        )
        yaml_values = load_yaml(os.path.join(back, "model.yaml"))
        assert yaml_values["tensor_model_parallel_size"] == IMPORT_LAYOUTS[name].tensor_parallel_size
        assert yaml_values.get("tokenizer_type") == cfg.data.tokenizer_type  # the copied tokenizer is configured
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
    result = export_hf(src, str(tmp_path / "t"), trim_vocab=True, dtype="bfloat16", progress=False)
    config = json.load(open(tmp_path / "t" / "config.json"))
    assert (result.vocab_size, config["vocab_size"], config["dtype"]) == (200, 200, "bfloat16")
    assert verify_export(src, str(tmp_path / "t")) < 1e-5
    from safetensors import safe_open

    with safe_open(str(tmp_path / "t" / SINGLE_FILE), "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
        assert f.get_tensor("transformer.wte.weight").shape == (200, 32)


def test_cli_export_verify_and_import(small, tmp_path, capsys):
    src = str(small / "ckpt")
    assert main(["export-hf", src, str(tmp_path / "h"), "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wrote GPT2LMHeadModel" in out and "verified" in out and "vocabulary kept padded: 208 rows" in out
    assert main(["export-hf", src, str(tmp_path / "h"), "--no-progress"]) == 2  # DST not empty, no --force
    assert "--force" in capsys.readouterr().err
    assert (
        main(
            [
                "import-hf",
                str(tmp_path / "h"),
                str(tmp_path / "c"),
                "--target-tensor-parallel-size",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    meta = read_metadata(resolve_iteration_dir(str(tmp_path / "c")))
    assert meta["layout"]["tp"] == 2 and meta["history"][0]["op"] == "import-hf" and not meta["optimizer"]
    assert main(["inspect", str(tmp_path / "c")]) == 0


@pytest.mark.parametrize("options,activation", [({}, "gelu_new"), ({"bias_gelu_fusion": False}, "gelu")])
def test_gpt2_gelu_exports_as_itself(options, activation, tmp_path):
    """Tanh GELU (biases + the default bias-GELU fusion) exports as gelu_new, exact GELU as gelu:
    transformers computes our logits. Weights of std 0.3 put GELU's inputs where the two
    formulas differ (the trained tiny models' are too small to tell them apart)."""
    _, state = run_steps(tiny_config(**options), ParallelState.single(), 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in state.model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    save_checkpoint(str(tmp_path / "ckpt"), state)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    theirs = load_hf(str(tmp_path / "hf"))
    assert theirs.config.activation_function == activation
    ours, cfg = reference_model(str(tmp_path / "ckpt"), str(tmp_path / "single"))
    check_same_function(ours, theirs, cfg.model.vocab_size, cfg.model.seq_length, generate=False)


def test_inexpressible_checkpoint_fails_in_cli(tmp_path, capsys):
    """LayerNorm + SwiGLU + rotary: export-hf exits 2 naming --normalization, writes nothing."""
    _, state = run_steps(tiny_config(**dict(ROPE, normalization="LayerNorm")), ParallelState.single(), 1)
    save_checkpoint(str(tmp_path / "ln"), state)
    assert main(["export-hf", str(tmp_path / "ln"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM" in err and "--normalization LayerNorm (Llama uses RMSNorm)" in err
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(str(tmp_path / "out") + ".tmp")


def test_export_without_transformers(small, tmp_path):
    """transformers blocked from importing: export-hf writes the files; only --verify fails, naming the extra."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from tools.convert_checkpoint import main\n"
        f"sys.exit(main(['export-hf', {str(small / 'ckpt')!r}, {str(tmp_path / 'x')!r}, '--verify', "
        "'--no-progress']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "verification needs transformers: pip install 'megatron_p2r[hf]'" in proc.stderr
    assert sorted(os.listdir(tmp_path / "x")) == ["config.json", "model.safetensors"]
