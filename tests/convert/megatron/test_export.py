"""export-megatron: ours -> Megatron-LM's format -> ours (import-megatron) gives back every weight
bit for bit, for a GPT (learned positions, LayerNorm, GELU, biases, tied), a Llama with
grouped-query attention (rope, RMSNorm, SwiGLU, untied), a Mixtral-style MoE, a Qwen-like
model, gpt-oss's options (sliding windows, learnable softmax offsets, clamped quick-GeGLU) and
DeepSeek-V3's pieces (MLA, a dense first layer, sigmoid group-limited routing, the expert bias, a
gated shared expert, an MTP layer), from TP=1 and TP=2 checkpoints (EP=2 for the MoEs), in
torch_dist and in legacy files; the
torch_dist keys and shapes are exactly those megatron-core 0.16.1's GPTModel asks for
(megatron_core_keys.json, written by megatron-core itself). The written files are
read back with the importer's allow-listed reader (no code is unpickled); the args are checked
to load with ``torch.load(weights_only=True)``, as Megatron loads them under its allow-list."""

import argparse
import json
import os

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.metadata import metadata_config, read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.checkpoint.tensor_table import tensor_table
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.megatron.args import MegatronConversionError
from megatron_p2r.convert.megatron.export_args import megatron_vocab, model_differences
from megatron_p2r.convert.megatron.exporter import export_megatron
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, TorchArchive, load_pickle
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.parallel.state import ParallelState
from tests.convert.hf.common import GQA, ROPE
from tests.helpers import run_steps, tiny_config
from tests.model.test_latent_attention import MLA
from tools.convert_checkpoint import main

MODELS = {
    "gpt": {},
    "llama": dict(ROPE, **GQA, num_query_groups=2, untie_embeddings_and_output_weights=True, disable_bias_linear=True),
    "moe": dict(
        ROPE,
        **GQA,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
        num_experts=4,
        moe_router_topk=2,
        moe_router_pre_softmax=False,
        moe_ffn_hidden_size=24,
    ),
    # head dim 16 in hidden 32, rotary on half of it, q/k norms, QKV-only biases, norm epsilon 1e-6
    "qwen": dict(
        ROPE,
        **GQA,
        num_query_groups=2,
        kv_channels=16,
        rotary_percent=0.5,
        qk_layernorm=True,
        norm_epsilon=1e-6,
        disable_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=True,
    ),
    # gpt-oss's options: windows in layer 0 (layer 1 full), sinks, clamped quick-GeGLU experts,
    # --rope-type rope as its script passes it (Megatron's default kind: not written, read back unset)
    "gptoss": dict(
        ROPE,
        rope_type="rope",
        **GQA,
        swiglu=False,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.5,
        softmax_type="learnable",
        window_size="3,0",
        window_attn_skip_freq=2,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
        num_experts=4,
        moe_router_topk=2,
        moe_router_pre_softmax=False,
        moe_ffn_hidden_size=24,
    ),
    # DeepSeek-V3's pieces: MLA, a dense first layer, sigmoid group-limited top-k scaled, the
    # expert bias, a gated shared expert, one MTP layer (an MoE layer, as the last)
    "deepseek": dict(
        ROPE,
        **MLA,
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
        num_experts=4,
        moe_router_topk=2,
        moe_router_pre_softmax=False,
        moe_ffn_hidden_size=24,
        moe_layer_freq=[0, 1],
        moe_router_score_function="sigmoid",
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
        mtp_num_layers=1,
    ),
}
FORMATS = ("torch_dist", "torch")
# per model: {sharded key: global shape, or null for an object} that megatron-core asks for
EXPECTED_KEYS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_core_keys.json")


def _perturbed_state(options):
    """A one-process model whose every weight is seeded noise (norms and biases not 1 and 0), and
    every expert bias (the decoder's routers' and the MTP layer's)."""
    _, state = run_steps(tiny_config(**options), ParallelState.single(), 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for name, bias in state.model.named_buffers():
            if name.endswith(".expert_bias"):
                bias.add_(0.01 * torch.randn(bias.shape, generator=g))
    return state


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{(model, tp): our checkpoint}: TP=1, and TP=2 (x EP=2 for the MoE) resharded from it."""
    root = tmp_path_factory.mktemp("ours")
    out = {}
    for name, options in MODELS.items():
        one = str(root / f"{name}_tp1")
        save_checkpoint(one, _perturbed_state(options))
        two = str(root / f"{name}_tp2")
        convert(one, two, Target(2, 1, None, 2 if options.get("num_experts") else 1), progress=False)
        out[(name, 1)], out[(name, 2)] = one, two
    return out


def _same_weights(a, b):
    src, back = SourceCheckpoint(a), SourceCheckpoint(b)
    assert model_differences(src.real_cfg.model, back.real_cfg.model) == []
    assert back.meta.get("expert_bias") == src.meta.get("expert_bias")  # exact: JSON doubles of fp32 values
    for key in tensor_table(src.real_cfg):
        assert torch.equal(back.read(key), src.read(key)), key


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", list(MODELS))
def test_round_trip_is_bitwise(sources, model, tp, fmt, tmp_path):
    src = sources[(model, tp)]
    par = metadata_config(read_metadata(resolve_iteration_dir(src))).parallel
    out, _ = export_megatron(src, str(tmp_path / "megatron"), ckpt_format=fmt, progress=False)
    assert os.path.basename(out) == "iter_0000000"
    with open(tmp_path / "megatron" / "latest_checkpointed_iteration.txt") as fh:
        assert fh.read() == "0"
    import_megatron(
        str(tmp_path / "megatron"),
        str(tmp_path / "back"),
        Target(par.tensor_model_parallel_size, 1, None, par.expert_model_parallel_size),
        progress=False,
    )
    _same_weights(src, str(tmp_path / "back"))


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_dist_keys_are_megatron_cores(sources, model, tmp_path):
    """Every key and global shape of the export's .metadata (read with the importer's
    allow-listed reader) is one megatron-core's model asks for, and none is missing."""
    out, _ = export_megatron(sources[(model, 1)], str(tmp_path / "m"), progress=False)
    metadata = load_pickle(os.path.join(out, ".metadata"), Kind.DCP_METADATA)
    written = {
        key: list(entry.field("size")) if entry.qualname.endswith("TensorStorageMetadata") else None
        for key, entry in metadata.field("state_dict_metadata").items()
    }
    with open(EXPECTED_KEYS) as fh:
        assert written == json.load(fh)[model]


def test_torch_dist_files_and_args(sources, tmp_path):
    """Megatron's torch_dist layout, and args that are plain data Megatron's torch.load admits."""
    export_megatron(sources[("moe", 2)], str(tmp_path / "m"), progress=False)
    iter_dir = tmp_path / "m" / "iter_0000000"
    assert sorted(os.listdir(iter_dir)) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((iter_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = TorchArchive(str(iter_dir / "common.pt"), Kind.MEGATRON).obj
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(iter_dir / "common.pt", weights_only=True)
    assert loaded["checkpoint_version"] == common["checkpoint_version"] == 3.0
    args = vars(loaded["args"])
    assert all(isinstance(v, (str, int, float, bool, type(None), list)) for v in args.values())
    assert (args["tensor_model_parallel_size"], args["expert_model_parallel_size"], args["num_experts"]) == (2, 2, 4)
    assert args["no_save_optim"] and args["no_save_rng"] and args["padded_vocab_size"] == 208


def test_legacy_ranks_pipeline_and_tied_output(sources, tmp_path):
    """Legacy files for TP=2 x PP=2: one per rank, layers from 0 on each stage, the last stage
    holding its copy of the tied embedding; importing them back gives the same weights."""
    export_megatron(sources[("gpt", 1)], str(tmp_path / "m"), ckpt_format="torch", tp=2, pp=2, progress=False)
    iter_dir = tmp_path / "m" / "iter_0000000"
    assert sorted(os.listdir(iter_dir)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = TorchArchive(str(iter_dir / "mp_rank_01_001" / "model_optim_rng.pt"), Kind.MEGATRON).obj["model"]
    first = TorchArchive(str(iter_dir / "mp_rank_01_000" / "model_optim_rng.pt"), Kind.MEGATRON).obj["model"]
    assert torch.equal(last["output_layer.weight"].read(), first["embedding.word_embeddings.weight"].read())
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in last and last["output_layer._extra_state"] is None
    import_megatron(str(tmp_path / "m"), str(tmp_path / "back"), Target(1, 1, None, 1), progress=False)
    _same_weights(sources[("gpt", 1)], str(tmp_path / "back"))


def test_cli(sources, tmp_path, capsys):
    assert (
        main(["export-megatron", sources[("llama", 2)], str(tmp_path / "m"), "--ckpt-format", "torch", "--no-progress"])
        == 0
    )
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2" in out and "--finetune" in out
    assert sorted(os.listdir(tmp_path / "m" / "iter_0000000")) == ["mp_rank_00", "mp_rank_01"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target-pipeline-parallel-size", "3"], "a stage would be empty"),
        (["--target-tensor-parallel-size", "3"], "error:"),
    ],
)
def test_bad_layout_is_refused(sources, tmp_path, capsys, argv, message):
    assert main(["export-megatron", sources[("gpt", 1)], str(tmp_path / "m"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "m")


@pytest.mark.parametrize(
    "options, argv, message",
    [
        (dict(num_experts=4, moe_num_prototypes=2, moe_router_topk=1), [], "--moe-num-prototypes 2"),
        (dict(num_layers=3), ["--target-pipeline-parallel-size", "2"], "does not divide the 3 layers"),
    ],
)
def test_inexpressible_model_is_refused(tmp_path, capsys, options, argv, message):
    save_checkpoint(str(tmp_path / "ckpt"), _perturbed_state(options))
    assert main(["export-megatron", str(tmp_path / "ckpt"), str(tmp_path / "m"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_export(sources, tmp_path, fmt):
    """--dtype bfloat16 writes bf16 weights (args.bf16), which import back as our weights rounded."""
    src = sources[("llama", 1)]
    export_megatron(src, str(tmp_path / "m"), ckpt_format=fmt, dtype="bfloat16", progress=False)
    iter_dir = tmp_path / "m" / "iter_0000000"
    header = TorchArchive(
        str(iter_dir / ("common.pt" if fmt == "torch_dist" else "mp_rank_00/model_optim_rng.pt")), Kind.MEGATRON
    ).obj
    assert header["args"].bf16 and not header["args"].fp16
    import_megatron(str(tmp_path / "m"), str(tmp_path / "back"), Target(1, 1, None, 1), progress=False)
    ours, back = SourceCheckpoint(src), SourceCheckpoint(str(tmp_path / "back"))
    for key in tensor_table(ours.real_cfg):
        assert torch.equal(back.read(key), ours.read(key).bfloat16().float()), key


def test_pseudo_phase_exports_delinked(tmp_path):
    """A pseudo-phase checkpoint (every layer calls one module) exports as the real model."""
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, _perturbed_state(dict(num_layers=4, p2r_phase="pseudo", share_pattern="all")))
    _, notes = export_megatron(ours, str(tmp_path / "m"), progress=False)
    assert any("delinked" in n for n in notes)
    import_megatron(str(tmp_path / "m"), str(tmp_path / "back"), Target(1, 1, None, 1), progress=False)
    _same_weights(ours, str(tmp_path / "back"))


def test_missing_source_is_an_error_line(tmp_path, capsys):
    assert main(["export-megatron", str(tmp_path / "nothing"), str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nothing" in err and "Traceback" not in err


def test_note_lists_the_flags_checkpoint_args_do_not_restore(tmp_path, capsys):
    """Megatron's --use-checkpoint-args leaves these to the command line: the note names them."""
    save_checkpoint(
        str(tmp_path / "ckpt"), _perturbed_state(dict(qk_layernorm=True, norm_epsilon=1e-6, bias_gelu_fusion=False))
    )
    assert (
        main(
            [
                "export-megatron",
                str(tmp_path / "ckpt"),
                str(tmp_path / "m"),
                "--no-progress",
                "--target-tensor-parallel-size",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "also pass --make-vocab-size-divisible-by 8 --norm-epsilon 1e-06 --qk-layernorm --no-bias-gelu-fusion "
        "(flags it does not restore)"
    ) in out


def test_megatron_vocabulary_pads_to_our_rows():
    """Megatron pads to a multiple of divisor x TP: the divisor written gives our padded rows."""
    m = ModelConfig(vocab_size=200, make_vocab_size_divisible_by=16)  # 208 rows
    for tp, divisor in [(1, 16), (2, 8), (16, 1), (13, 16)]:
        assert megatron_vocab(m, tp) == (200, divisor)
        assert -(-200 // (divisor * tp)) * divisor * tp == m.padded_vocab_size
    with pytest.raises(MegatronConversionError, match="208 rows"):
        megatron_vocab(m, 3)


@pytest.mark.parametrize("fmt, layout", [("torch_dist", Target(2, 1, None, 2)), ("torch", Target(1))])
def test_router_bias_round_trips(fmt, layout, tmp_path):
    """A MoE with biases (gpt-oss's router bias, megatron-core's Router.bias under
    --add-bias-linear) exports as ``decoder.layers.mlp.router.bias`` and comes back bit for bit."""
    one, src = str(tmp_path / "one"), str(tmp_path / "src")
    save_checkpoint(one, _perturbed_state(dict(MODELS["gptoss"], disable_bias_linear=False)))
    convert(one, src, layout, progress=False)
    out, _ = export_megatron(src, str(tmp_path / "megatron"), ckpt_format=fmt, progress=False)
    if fmt == "torch_dist":
        metadata = load_pickle(os.path.join(out, ".metadata"), Kind.DCP_METADATA)
        assert list(metadata.field("state_dict_metadata")["decoder.layers.mlp.router.bias"].field("size")) == [2, 4]
    import_megatron(str(tmp_path / "megatron"), str(tmp_path / "back"), layout, progress=False)
    _same_weights(src, str(tmp_path / "back"))
