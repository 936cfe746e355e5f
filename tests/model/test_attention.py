"""Grouped-query attention, --kv-channels, --qk-layernorm and --rotary-percent (and under TP,
gpt-oss's window, sinks and clamped quick-GeGLU: tests/model/test_gpt_oss.py compares them with
transformers on one process).

One process: the attention module equals attention written out by hand (keys and values
repeated over each group's query heads, q/k norms over the head dimension, rotary on the first
fraction of each head); --group-query-attention with as many groups as heads is the fused
multi-head model with its rows regrouped (the layouts of layout.tensor_specs.HeadRows).

TP: TP2 x DP2 and TP4 with G = 1, 2 and heads (TP > G replicates key/value heads over TP/G
ranks) reproduce the one-process model -- loss and every gradient shard after one step (with
the plan's reductions), and losses over 3 optimizer steps -- and the key/value replicas stay
bitwise identical over their TP ranks. Tolerance as tests/parallel/test_layers.py: fp32, TP
changes only the order of reductions (gradients 2e-5 absolute, losses 1e-5 relative).
"""

import hashlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import reference_config, run_steps, tiny_config
from tests.pipeline.common import compare_case

ROPE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
GQA = dict(group_query_attention=True)
# name: (TP, groups, model options); 4 heads, 4 ranks (DP fills the rest)
CASES = {
    "tp4_g1": (4, 1, dict(ROPE, qk_layernorm=True, kv_channels=12, rotary_percent=0.5)),
    "tp4_g2": (4, 2, {}),  # learned positions, LayerNorm, biases everywhere
    "tp4_g4": (4, 4, dict(ROPE, disable_bias_linear=True, add_qkv_bias=True)),
    "tp2_g1": (2, 1, dict(qk_layernorm=True)),  # LayerNorm q/k norms: weight and bias
    "tp2_g2": (2, 2, dict(ROPE, rotary_percent=0.5)),
    "tp2_g4": (2, 4, dict(ROPE, kv_channels=16, qk_l2_norm=True)),  # each rank's heads L2-normalised
    # gpt-oss: a window on layer 0, sinks split with the heads, quick-GeGLU clamped in the dense and expert MLPs
    "tp2_g2_gpt_oss": (
        2,
        2,
        dict(
            position_embedding_type="rope",
            normalization="RMSNorm",
            window_size="5,0",
            window_attn_skip_freq=2,
            softmax_type="learnable",
            quick_geglu=True,
            glu_linear_offset=1.0,
            activation_func_clamp_value=0.1,
            num_experts=4,
            moe_layer_freq=2,
        ),
    ),
    # OLMo 2: norms on the branch outputs (sequence shards), q/k norms over all heads (key heads replicated)
    "tp4_g2_olmo2": (
        4,
        2,
        dict(ROPE, layer_norms="output", qk_layernorm=True, qk_layernorm_over_heads=True, sequence_parallel=True),
    ),
    "tp2_g2_both_norms": (2, 2, dict(ROPE, layer_norms="both")),
}
STEPPED = ("tp4_g1", "tp4_g2", "tp2_g1", "tp4_g2_olmo2")  # key/value heads replicated: 3 optimizer steps


def _config(tp, groups, options, **more):
    return tiny_config(
        **GQA, num_query_groups=groups, tensor_model_parallel_size=tp, global_batch_size=4, **options, **more
    )


def _replica_digests(model, ps):
    """{name: digest of each TP rank's copy} of the key/value weights."""
    out = {}
    for name, p in model.named_parameters():
        if ".key_value." in name:
            mine = hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
            everyone = [None] * ps.tp_size
            dist.all_gather_object(everyone, mine, group=ps.group("tp"))
            out[name] = everyone
    return out


def _gqa_rank(rank, world):
    out = {}
    for name, (tp, groups, options) in CASES.items():
        cfg = _config(tp, groups, options)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        case = compare_case(cfg, ps.layout, ps, "1f1b", n_micro=2)
        out[name] = {
            "loss_err": case["loss_err"],
            "grad_err": case["grad_err"],
            "tp_rank": ps.tp_rank,
            "grad_rel_err": case["grad_rel_err"],
        }
        if name in STEPPED:
            losses, state = run_steps(cfg, ps, 3)
            ref_losses, _ = run_steps(reference_config(cfg), ParallelState.single(), 3)
            out[name].update(losses=losses, ref_losses=ref_losses, replicas=_replica_digests(state.model, ps))
    return out


def test_gqa_under_tp_reproduces_one_process_and_replicas_stay_identical():
    results = run_distributed(_gqa_rank, 4, timeout=600)
    for r in results:
        for name, (tp, groups, _) in CASES.items():
            res = r[name]
            # (OLMo 2's gradients reach ~80, with norms on the branches and none on the stream: relative)
            assert res["loss_err"] < 1e-5 and (res["grad_err"] < 2e-5 or res["grad_rel_err"] < 2e-6), (name, res)
            if name in STEPPED:
                assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5), name
                block = tp // min(tp, groups)
                for tensor, copies in res["replicas"].items():
                    for start in range(0, tp, block):  # one block of TP ranks per key/value head
                        assert len(set(copies[start : start + block])) == 1, (name, tensor, copies)
                    assert len(set(copies)) == min(tp, groups), (name, tensor)  # distinct heads differ


# ----------------------------------------------------------------------------- one process


def _by_hand(attn, cfg, x):
    """The attention module's output written out: separate projections, keys/values repeated
    over their group's query heads, norms over the head dimension, partial rotary, causal softmax."""
    m = cfg.model
    b, s, _ = x.shape
    heads, groups, d = m.num_attention_heads, m.query_groups, m.head_dim
    q = F.linear(x, attn.query.weight, attn.query.bias).view(b, s, heads, d)
    kv = F.linear(x, attn.key_value.weight, attn.key_value.bias).view(b, s, groups, 2, d)
    k, v = kv[..., 0, :], kv[..., 1, :]
    k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))  # query head i uses group i // (H/G)
    q, k = attn.q_layernorm(q), attn.k_layernorm(k)
    rot = m.rotary_dim
    angle = torch.arange(s)[:, None] * m.rotary_base ** (-torch.arange(0, rot, 2) / rot)  # [s, rot/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rotate(t):
        a, c, rest = t[..., : rot // 2], t[..., rot // 2 : rot], t[..., rot:]
        return torch.cat([a * cos - c * sin, c * cos + a * sin, rest], dim=-1)

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, heads * d)
    return attn.proj(y)


@pytest.mark.parametrize("groups", [1, 2])
def test_attention_equals_the_written_out_computation(groups):
    cfg = tiny_config(
        **ROPE, **GQA, num_query_groups=groups, kv_channels=12, qk_layernorm=True, rotary_percent=0.5, add_qkv_bias=True
    )
    model = build_model(cfg, ParallelState.single())
    with torch.no_grad():  # q/k norm weights away from 1 so that they count
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("query.bias"):
                p.uniform_(0.5, 1.5)
    attn = model.layers["0"].attention
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    rope = model.rope(16, x.device)
    torch.testing.assert_close(attn(x, rope), _by_hand(attn, cfg, x), rtol=1e-5, atol=1e-5)


def test_groups_equal_to_heads_is_the_fused_multi_head_model():
    """--group-query-attention --num-query-groups H computes what the fused QKV model does once
    its rows [heads, (q, k, v), d] are regrouped as query [heads, d] and key_value [heads, (k, v), d]."""
    fused_cfg = tiny_config(**ROPE)
    fused = build_model(fused_cfg, ParallelState.single())
    grouped = build_model(tiny_config(**ROPE, **GQA, num_query_groups=4), ParallelState.single())
    source = dict(fused.named_parameters())
    with torch.no_grad():
        for name, p in grouped.named_parameters():
            prefix = name.rsplit(".attention.", 1)[0] + ".attention.qkv." + name.rsplit(".", 1)[1]
            if ".attention.query." in name:
                p.copy_(source[prefix].unflatten(0, (4, 3, -1))[:, 0].flatten(0, 1))
            elif ".attention.key_value." in name:
                p.copy_(source[prefix].unflatten(0, (4, 3, -1))[:, 1:].flatten(0, 2))
            else:
                p.copy_(source[name])
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(grouped(tokens=ids), fused(tokens=ids), rtol=1e-5, atol=1e-5)


def test_plan_sums_partial_gradients_over_tp_blocks():
    """Key/value heads replicated over TP/G ranks, and q/k norm weights, are reduced over those
    TP ranks (x DP); each counts once in the gradient norm."""
    cfg = tiny_config(
        **GQA,
        num_query_groups=2,
        qk_layernorm=True,
        tensor_model_parallel_size=8,
        num_attention_heads=8,
        global_batch_size=4,
    )
    plan = ParallelPlan.for_world(cfg, 16)
    kv, q = "layers.0.attention.key_value.weight", "layers.0.attention.query.weight"
    assert plan.reduction(kv, False).tp_block == 4 and plan.reduction(kv, False).kind == "tp_partial"
    assert plan.reduction("layers.0.attention.q_layernorm.weight", False).tp_block == 8
    assert plan.reduction(q, False).tp_block == 1 and plan.reduction(q, False).kind == "dp"
    assert plan.tp_block_sets() == (((), 4), ((), 8))
    counted = [t for t in range(8) if plan.counts_in_norm(kv, 0, False, plan.layout.coords(t))]
    assert counted == [0, 4]
    specs = {s.name: s for s in plan.tensors(0)}
    assert specs[kv].shape == (2 * 4, 32) and specs[kv].tp_replicas == 4 and specs[q].shape == (4, 32)
    pseudo = tiny_config(
        **GQA,
        num_query_groups=1,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="all",
        global_batch_size=4,
    )
    shared = ParallelPlan.for_world(pseudo, 4).reduction(kv, False)  # a slot on both stages, replicated over TP
    assert (shared.kind, shared.stages, shared.tp_block) == ("sharing", (0, 1), 2)


@pytest.mark.parametrize(
    "options, world, message",
    [
        (dict(num_query_groups=3), 1, "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
        (
            dict(
                num_query_groups=4,
                num_attention_heads=12,
                hidden_size=48,
                tensor_model_parallel_size=6,
                make_vocab_size_divisible_by=48,
            ),
            6,
            "--num-query-groups (4) and --tensor-model-parallel-size (6) must divide one another",
        ),
        (dict(ROPE, rotary_percent=0.2), 1, "--rotary-percent 0.2 of head dimension 8 gives 1"),
        (dict(rotary_percent=1.5), 1, "--rotary-percent must be <= 1, got 1.5 (range (0, 1])"),
        (dict(num_attention_heads=6), 1, "(or set --kv-channels)"),
    ],
)
def test_attention_options_are_checked(options, world, message):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**GQA, global_batch_size=8, **options), world)
    assert message in str(err.value)


def test_accepted_attention_options():
    """TP 8 over 2 groups (each replicated over 4 ranks); 6 heads of --kv-channels 8 in hidden 32."""
    gqa = tiny_config(
        **GQA, num_query_groups=2, num_attention_heads=8, tensor_model_parallel_size=8, global_batch_size=8
    )
    validate(gqa, 8)
    rope = tiny_config(**ROPE, num_attention_heads=6, kv_channels=8, rotary_percent=0.5)
    validate(rope, 1)
    assert (gqa.model.num_query_groups, rope.model.kv_channels * rope.model.num_attention_heads) == (2, 48)


def test_megatron_flag_names_and_defaults():
    """The flags parse under Megatron-LM's names; the defaults are Megatron-LM's (no GQA,
    --num-query-groups 1 ignored without it, head dim hidden/heads, whole-head rotary)."""
    from megatron_p2r.arguments import parse_args

    m = parse_args(
        [
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "16",
            "--qk-layernorm",
            "--rotary-percent",
            "0.5",
            "--add-qkv-bias",
            "--hidden-size",
            "32",
        ]
    ).model
    assert (m.query_groups, m.head_dim, m.qk_layernorm, m.rotary_dim, m.add_qkv_bias) == (2, 16, True, 8, True)
    d = parse_args(["--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2"]).model
    assert (d.group_query_attention, d.query_groups, d.kv_channels, d.head_dim, d.rotary_percent) == (
        False,
        4,
        None,
        8,
        1.0,
    )
