"""DeepSeek-V3's MoE layers, expert bias and multi-token prediction through import-hf and export-hf.

The fixture tests/fixtures/hf_deepseek_v3/tiny_moe was written by transformers' own
DeepseekV3ForCausalLM (make_fixture.py beside it): a dense first layer, then 8 sigmoid-routed
experts in 4 groups (top-4 within the 2 best), 2 shared experts, routed_scaling_factor 1.5 and a
non-zero e_score_correction_bias that changes the routing. Imported under EP 2, our one-process
model computes transformers' logits (fp32, <= 1e-5) with the bias in metadata.json; exported back,
every tensor is the fixture's bit for bit. The imported model trains under EP 2 and TP 2 as on one
process (losses, and the expert biases after 3 steps bitwise). transformers' model has no
multi-token prediction: ours is exported as DeepSeek's files hold it (decoder layer
num_hidden_layers), which transformers skips (same logits) and which our depth computes as a
reader of that layout does, its router's non-zero expert bias included; imported back, every
piece and bias is bit-exact.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_p2r.arguments import config_from_values, load_yaml
from megatron_p2r.checkpoint.expert_bias import FIELD as EXPERT_BIAS
from megatron_p2r.checkpoint.expert_bias import bias_name, mtp_bias_name
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import DEEPSEEK_V3, HFConversionError, hf_architecture
from megatron_p2r.convert.hf.deepseek_v3 import latent_fields, latent_values
from megatron_p2r.convert.hf.directory import SINGLE_FILE
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.hf.verify import verify_export
from megatron_p2r.convert.reshard import Target
from megatron_p2r.model.mtp import roll_left
from megatron_p2r.training import build_train_state
from megatron_p2r.parallel.state import ParallelState
from tests.convert.hf.common import TOL, check_same_function, load_hf, reference_model
from tests.harness import run_distributed

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "hf_deepseek_v3", "tiny_moe")
DENSE_FIXTURE = os.path.join(os.path.dirname(FIXTURE), "tiny")
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _imported(tmp_path, target=Target(1), fixture=FIXTURE):
    import_hf(fixture, str(tmp_path / "ours"), target, make_vocab_size_divisible_by=8, progress=False)
    return reference_model(str(tmp_path / "ours"), str(tmp_path / "single"))


def test_fixture_imports_at_transformers_logits_and_exports_back_unchanged(tmp_path):
    ours, cfg = _imported(tmp_path, Target(1, 1, None, 2))
    m = cfg.model
    routing = (m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk)
    assert routing == (8, 4, 4, 2) and [m.is_moe_layer(i) for i in range(2)] == [False, True]
    assert (m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size, m.moe_router_topk_scaling_factor) == (
        12,
        24,
        1.5,
    )
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias and not m.mtp_num_layers
    fixture = load_file(os.path.join(FIXTURE, SINGLE_FILE))
    saved = read_metadata(resolve_iteration_dir(str(tmp_path / "ours")))[EXPERT_BIAS]
    assert saved == {bias_name(1): fixture[BIAS].tolist()} and fixture[BIAS].abs().min() > 0
    theirs = load_hf(FIXTURE)
    check_same_function(ours, theirs, 201, 16, generate=False)
    with torch.no_grad():  # the fixture can fail: without its bias transformers routes otherwise
        ids = torch.randint(0, 201, (2, 16), generator=torch.Generator().manual_seed(0))
        biased = theirs(input_ids=ids).logits
        theirs.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
        assert not torch.allclose(theirs(input_ids=ids).logits, biased, **TOL)

    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), trim_vocab=True, progress=False)
    assert result.architecture == DEEPSEEK_V3
    exported = load_file(str(tmp_path / "back" / SINGLE_FILE))
    assert exported.keys() == fixture.keys()
    for name, t in fixture.items():
        assert torch.equal(exported[name], t), name
    config = json.load(open(tmp_path / "back" / "config.json"))
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["num_nextn_predict_layers"]) == (
        1,
        2,
        0,
    )
    check_same_function(ours, load_hf(str(tmp_path / "back")), 201, 16)
    assert verify_export(str(tmp_path / "ours"), str(tmp_path / "back")) < 1e-4  # export-hf --verify


def _with_prediction_layer(tmp_path, fixture):
    """Our checkpoint of the imported model plus one prediction depth of seeded noise (an MoE
    depth's router bias too: non-zero, as DeepSeek-V3's published depth's)."""
    imported, cfg = _imported(tmp_path, fixture=fixture)
    state = build_train_state(cfg.replace(mtp_num_layers=1), ParallelState.single())
    missing, unexpected = state.model.load_state_dict(imported.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("mtp.") for k in missing)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if name.startswith("mtp."):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, bias in state.model.named_buffers():
            if name.startswith("mtp.") and name.endswith(".expert_bias"):
                bias.add_(0.5 * torch.rand(bias.shape, generator=g) - 0.25)
    save_checkpoint(str(tmp_path / "mtp"), state)
    return state.model.eval()


def _their_prediction(directory, ids):
    """Depth 1's logits as a reader of DeepSeek's layout computes them (vLLM's DeepSeekMTP):
    eh_proj([enorm(embed(next ids)), hnorm(main model's final hidden state)]), decoder layer 2,
    shared_head.norm, shared_head.head; transformers' modules and the exported tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    theirs = load_hf(directory, unexpected=r"model\.layers\.2\.")
    # decoder layer 2 as transformers' own loader reads it (into a model of 3 layers)
    layer = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, num_hidden_layers=3).model.layers[2]
    prefix = "model.layers.2."
    weights = {
        k[len(prefix) :]: t for k, t in load_file(os.path.join(directory, SINGLE_FILE)).items() if k.startswith(prefix)
    }
    c = theirs.config
    norms = {n: DeepseekV3RMSNorm(c.hidden_size, c.rms_norm_eps) for n in ("enorm", "hnorm", "shared_head.norm")}
    for name, norm in norms.items():
        norm.load_state_dict({"weight": weights[name + ".weight"]})
    with torch.no_grad():
        hidden = theirs.model(input_ids=ids).last_hidden_state
        embedded = torch.nn.functional.embedding(roll_left(ids), weights["embed_tokens.weight"])
        x = torch.cat([norms["enorm"](embedded), norms["hnorm"](hidden)], -1) @ weights["eh_proj.weight"].t()
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        x = layer(
            x, attention_mask=None, position_ids=positions, position_embeddings=theirs.model.rotary_emb(x, positions)
        )
        return norms["shared_head.norm"](x) @ weights["shared_head.head.weight"].t()


def _our_prediction(model, ids):
    hidden = {}
    model.final_norm.register_forward_hook(lambda mod, args, out: hidden.setdefault("h", out))
    with torch.no_grad():
        logits = model(tokens=ids)
        positions = roll_left(torch.arange(ids.shape[1]))
        x = model.mtp.layers[0](
            hidden["h"], model._mtp_embed(roll_left(ids), positions), model.rope(ids.shape[1], None)
        )
        return logits, model._output(x, None, None)


@pytest.mark.parametrize("moe", [True, False])
def test_prediction_layer_exports_in_deepseek_layout_and_imports_back_bit_exact(tmp_path, moe):
    """The MoE fixture's depth is an MoE layer; the dense fixture's (tiny/) a dense one, which
    first_k_dense_replace = layers + depths tells readers."""
    ours = _with_prediction_layer(tmp_path, FIXTURE if moe else DENSE_FIXTURE)
    export_hf(str(tmp_path / "mtp"), str(tmp_path / "hf"), trim_vocab=True, progress=False)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert (config["num_nextn_predict_layers"], config["first_k_dense_replace"]) == (1, 1 if moe else 3)
    ids = torch.randint(0, 201, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, predicted = _our_prediction(ours, ids)
    theirs = load_hf(str(tmp_path / "hf"), unexpected=r"model\.layers\.2\.")  # transformers skips the layer
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, logits[..., :201], **TOL)
    torch.testing.assert_close(_their_prediction(str(tmp_path / "hf"), ids), predicted[..., :201], **TOL)

    # imported under TP 2 (x EP 2: the depth's experts split too; eh_proj split by rows)
    back = Target(2, 1, None, 2 if moe else 1)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), back, make_vocab_size_divisible_by=8, progress=False)
    a, b = SourceCheckpoint(str(tmp_path / "mtp")), SourceCheckpoint(str(tmp_path / "back"))
    assert b.real_cfg.model.mtp_num_layers == 1 and a.table.keys() == b.table.keys()
    for key in a.table:
        assert torch.equal(a.read(key), b.read(key)), key
    assert a.meta.get(EXPERT_BIAS) == b.meta.get(EXPERT_BIAS)
    tensors = load_file(str(tmp_path / "hf" / SINGLE_FILE))
    if moe:  # the depth's router bias: written (fp32, as transformers keeps it) and read back exactly
        depth_bias = a.expert_bias(mtp_bias_name(0))
        assert depth_bias.abs().min() > 0 and b.meta[EXPERT_BIAS][mtp_bias_name(0)] == depth_bias.tolist()
        assert torch.equal(tensors["model.layers.2.mlp.gate.e_score_correction_bias"], depth_bias)

    # what our model cannot hold is refused: a depth's own embedding copy
    name = "model.layers.2.embed_tokens.weight"
    changed = str(tmp_path / "changed")
    shutil.copytree(tmp_path / "hf", changed)
    save_file({**tensors, name: tensors[name] + 0.5}, os.path.join(changed, SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="differs from 'model.embed_tokens.weight'; our model shares one"):
        import_hf(changed, str(tmp_path / "refused"), Target(1), progress=False)


def test_bf16_export_keeps_the_expert_bias_in_fp32(tmp_path):
    """transformers keeps e_score_correction_bias in fp32 whatever the dtype: so does the export."""
    import_hf(FIXTURE, str(tmp_path / "ours"), Target(1), make_vocab_size_divisible_by=8, progress=False)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), trim_vocab=True, dtype="bfloat16", progress=False)
    exported, fixture = load_file(str(tmp_path / "hf" / SINGLE_FILE)), load_file(os.path.join(FIXTURE, SINGLE_FILE))
    assert exported[BIAS].dtype == torch.float32 and torch.equal(exported[BIAS], fixture[BIAS])
    assert exported["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert load_hf(str(tmp_path / "hf")).model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def _hf_with(tmp_path, change):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURE, src)
    config = json.load(open(src / "config.json"))
    json.dump({**config, **change}, open(src / "config.json", "w"))
    return str(src)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob false with num_experts_per_tok 4: Megatron's sigmoid router"),
        ({"topk_group": 1}, "num_experts_per_tok 4 with topk_group 1: transformers scores a group by its top-2"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax': only sigmoid"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"topk_method": "greedy"}, "topk_method 'greedy': transformers' DeepseekV3 routes as noaux_tc"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05: transformers normalises the latents with eps 1e-06"),
    ],
)
def test_what_is_not_read_is_refused_by_field(tmp_path, change, message):
    with pytest.raises(HFConversionError, match=message.replace("(", r"\(")):
        import_hf(_hf_with(tmp_path, change), str(tmp_path / "ours"), Target(1), progress=False)


DEEPSEEK = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    multi_latent_attention=True,
    kv_lora_rank=8,
    qk_layernorm=True,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    norm_epsilon=1e-6,
    num_experts=8,
    moe_ffn_hidden_size=32,
    moe_router_topk=4,
    moe_router_score_function="sigmoid",
    moe_shared_expert_intermediate_size=64,
)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax (DeepseekV3's router"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=4), "--moe-router-topk 4 with --moe-router-group-topk 4"),
        (dict(moe_shared_expert_gate=True), "--moe-shared-expert-gate"),
        (dict(moe_shared_expert_intermediate_size=None), "no --moe-shared-expert-intermediate-size"),
        (dict(moe_shared_expert_intermediate_size=40), "--moe-shared-expert-intermediate-size 40"),
        (dict(moe_layer_freq=2, num_layers=4), "--moe-layer-freq 2 (DeepseekV3's MoE layers"),
        (dict(norm_epsilon=1e-5), "--norm-epsilon 1e-05 (transformers' DeepseekV3 normalises its latents"),
    ],
)
def test_what_deepseek_v3_cannot_say_is_refused_on_export(change, message):
    assert hf_architecture(ModelConfig(**DEEPSEEK)) == DEEPSEEK_V3
    with pytest.raises(HFConversionError, match=message.replace("(", r"\(")):
        hf_architecture(ModelConfig(**{**DEEPSEEK, **change}))


def _train(rank, world, runs):
    from megatron_p2r.training import pretrain

    out = {}
    for name, values in runs.items():
        losses = pretrain(config_from_values(values))["losses"]
        out[name] = (losses, read_metadata(resolve_iteration_dir(values["save"]))[EXPERT_BIAS])
    return out


def _train_values(directory):
    return {
        **load_yaml(os.path.join(directory, "model.yaml")),
        "load": directory,
        "finetune": True,
        "save": directory + "_trained",
        "save_interval": 3,
        "vocab_size": 201,
        "mock_data": True,
        "seed": 7,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "seq_length": 16,
        "train_iters": 3,
        "lr": 1e-2,
        "lr_decay_style": "constant",
        "clip_grad": 0.0,
        "moe_router_bias_update_rate": 0.2,
        "device": "cpu",
        "log_interval": 100,
        "eval_iters": 0,
    }


def test_imported_model_trains_under_ep2_and_tp2_as_one_process(tmp_path):
    """3 steps of the imported model under EP 2 and TP 2 (2 ranks) give the one-process losses, and
    the same expert biases bitwise (sums of +-rate steps: every routing count agreed). The rate,
    0.2, is large beside the fixture's biases (|b| <= 0.5): steps 2 and 3 route by updated biases."""
    layouts = {"ep2": Target(1, 1, None, 2), "tp2": Target(2), "single": Target(1)}
    values = {}
    for name, target in layouts.items():
        import_hf(FIXTURE, str(tmp_path / name), target, make_vocab_size_divisible_by=8, progress=False)
        values[name] = _train_values(str(tmp_path / name))
    reference = _train(0, 1, {"single": values.pop("single")})["single"]
    parallel = run_distributed(_train, 2, values, timeout=600)[0]
    losses, biases = reference
    assert (
        len(losses) == 3
        and losses[0] != losses[2]
        and biases[bias_name(1)] != load_file(os.path.join(FIXTURE, SINGLE_FILE))[BIAS].tolist()
    )
    for name, (run_losses, run_biases) in parallel.items():
        assert run_losses == pytest.approx(losses, rel=1e-5), name
        assert run_biases == biases, name


def test_dense_first_layers_are_megatrons_list_form_both_ways():
    """first_k_dense_replace k of L layers is --moe-layer-freq ([0]*k+[1]*(L-k)), and back."""
    config = json.load(open(os.path.join(FIXTURE, "config.json")))
    values = latent_values({**config, "num_hidden_layers": 5, "first_k_dense_replace": 3}, "config.json")
    assert values["moe_layer_freq"] == [0, 0, 0, 1, 1]
    m = ModelConfig(**{**DEEPSEEK, "num_layers": 5, "moe_layer_freq": values["moe_layer_freq"]})
    assert latent_fields(m)["first_k_dense_replace"] == 3
    assert latent_values({**config, "first_k_dense_replace": 0}, "config.json")["moe_layer_freq"] == 1


def test_pseudo_phase_exports_each_layer_with_its_slots_bias(tmp_path):
    """A pseudo-phase model (one slot called by both layers, one prediction depth) trained 3 steps
    exports delinked: each layer's e_score_correction_bias is the slot's (non-zero after the
    updates), and transformers' logits equal our delinked model's."""
    from tests.helpers import run_steps, tiny_config

    options = dict(
        DEEPSEEK,
        qk_head_dim=6,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.05,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=1.5,
        mtp_num_layers=1,
        untie_embeddings_and_output_weights=True,
        init_method_std=0.2,
        p2r_phase="pseudo",
        share_pattern="all",
    )
    _, state = run_steps(tiny_config(**options), ParallelState.single(), 3)
    save_checkpoint(str(tmp_path / "pseudo"), state)
    slot = state.model.layers["0"].mlp.router.expert_bias
    assert slot.abs().sum() > 0
    export_hf(str(tmp_path / "pseudo"), str(tmp_path / "hf"), progress=False)
    exported = load_file(str(tmp_path / "hf" / SINGLE_FILE))
    for layer in range(2):
        assert torch.equal(exported[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"], slot), layer
    ours, _ = reference_model(str(tmp_path / "pseudo"), str(tmp_path / "real"))
    check_same_function(ours, load_hf(str(tmp_path / "hf"), unexpected=r"model\.layers\.2\."), 64, 16)
