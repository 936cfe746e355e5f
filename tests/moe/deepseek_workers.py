"""Ranks of tests/moe/test_deepseek_parallel.py: 3 training steps of a DeepSeek-style MoE
(sigmoid routing, group-limited top-k, scaled weights, expert bias, seq_aux_loss, gated shared
experts, one MoE multi-token prediction depth with its own router and bias) under each layout,
what the test compares with the one-process run."""

from __future__ import annotations

import os

import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.moe.expert_bias import biased_routers
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.training.launch import setup_parallel
from tests.helpers import expected_shard, keep_first_step_grads, run_steps, tiny_config

DEEPSEEK = dict(
    num_layers=2,
    num_experts=8,
    moe_router_topk=4,
    moe_router_score_function="sigmoid",
    moe_router_topk_scaling_factor=2.5,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
    disable_bias_linear=True,
    swiglu=True,
    init_method_std=0.2,  # decisive routing: no near-ties between experts
    global_batch_size=8,
    position_embedding_type="rope",  # MTP under PP2 needs no position table on the last stage
    mtp_num_layers=1,  # an MoE depth (the last layer's kind): its router's bias is updated too
)

# label -> the layout's flags (world 2)
CASES = {
    "ep2": dict(
        expert_model_parallel_size=2,
        overlap_moe_expert_parallel_comm=True,
        moe_shared_expert_overlap=True,
        moe_grouped_gemm=True,
    ),
    "ep2-serial-distopt": dict(
        expert_model_parallel_size=2, moe_shared_expert_overlap=True, use_distributed_optimizer=True
    ),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2-pseudo": dict(pipeline_model_parallel_size=2, p2r_phase="pseudo", share_pattern="all"),
}


def case_config(label: str):
    return tiny_config(**DEEPSEEK, **CASES[label])


def biases(model) -> dict:
    return {key: router.expert_bias.clone() for key, router in biased_routers(model).items()}


def observe(cfg, ps, steps: int = 3) -> dict:
    """Losses, grad norms, first-step gradients (this rank's), weights and expert biases after ``steps``."""
    grads, records = {}, []
    losses, state = run_steps(cfg, ps, steps, after_step=keep_first_step_grads(grads), outputs=records)
    state.ddp.finish_param_sync()
    params = dict(state.model.named_parameters())
    return {
        "losses": losses,
        "grad_norms": [r["grad_norm"] for r in records],
        "grads": {n: g for n, g in grads.items()},
        "weights": {n: p.detach().float().clone() for n, p in params.items()},
        "meta": {
            n: (logical_name(n, p), getattr(p, "expert", False), getattr(p, "tp_dim", None)) for n, p in params.items()
        },
        "biases": biases(state.model),
        "coords": (ps.tp_rank, ps.tp_size, ps.ep_rank, ps.ep_size, ps.pp_rank),
        "state": state,
    }


def compare(run: dict, ref: dict, ps) -> dict:
    """The largest differences of ``run`` (this rank) from the one-process ``ref``."""
    state = run.pop("state")
    out = {
        "loss_err": max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)),
        "norm_err": max(abs(a - b) for a, b in zip(run["grad_norms"], ref["grad_norms"], strict=True)),
        "grad_err": 0.0,
        "weight_err": 0.0,
        "bias_equal": all(torch.equal(b, ref["biases"][k]) for k, b in run["biases"].items()),
        "bias_moved": all(b.abs().sum().item() > 0 for b in run["biases"].values()),
        "bias_keys": sorted(run["biases"]),
        "names": sorted(run["meta"][n][0] for n in run["grads"]),
    }
    params = dict(state.model.named_parameters())
    for n, g in run["grads"].items():
        if getattr(params[n], "main_grad", None) is None or state.cfg.parallel.use_distributed_optimizer:
            continue
        want = expected_shard(ref["grads"][run["meta"][n][0]], params[n], ps)
        out["grad_err"] = max(out["grad_err"], (g - want).abs().max().item())
    for n, w in run["weights"].items():
        want = expected_shard(ref["weights"][run["meta"][n][0]], params[n], ps)
        out["weight_err"] = max(out["weight_err"], (w - want).abs().max().item())
    return out


def rows_through_all_to_all(ps) -> dict:
    """One forward and backward of an EP2 MoE layer with (overlapped) shared experts: the rows of
    hidden states this rank sent through all-to-alls, and the assignments it routed."""
    from megatron_p2r.config import ModelConfig
    from megatron_p2r.model.mlp import SharedExperts
    from megatron_p2r.moe.layer import MoELayer
    from megatron_p2r.parallel import mappings
    from megatron_p2r.parallel.sharding import init_parameters

    fields = {k: v for k, v in DEEPSEEK.items() if k != "global_batch_size"}
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, moe_shared_expert_overlap=True, **fields)
    layer = MoELayer(cfg, ps, shared_experts=SharedExperts(cfg, ps))
    init_parameters(layer, 3, ps.tp_rank, ps.tp_size, ps.ep_rank)
    sent, original = [], mappings.start_all_to_all

    def counting(x, out_splits, in_splits, group):
        if x.is_floating_point() and x.dim() == 2 and x.shape[-1] == 32:
            sent.append(x.shape[0])
        return original(x, out_splits, in_splits, group)

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(ps.ep_rank), requires_grad=True)
    mappings.start_all_to_all = counting
    try:
        layer(x).square().sum().backward()
    finally:
        mappings.start_all_to_all = original
    return {"sent": sum(sent), "assignments": x.shape[0] * x.shape[1] * cfg.moe_router_topk}


def world2(rank: int, world: int, references_path: str, root: str) -> dict:
    references, out = torch.load(references_path, weights_only=True), {}
    for label in CASES:
        cfg = case_config(label)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        run = observe(cfg, ps)
        if label in ("ep2-serial-distopt", "pp2-pseudo"):
            save_checkpoint(os.path.join(root, label), run["state"])
        out[label] = compare(run, references[label], ps)
        if label == "ep2":
            out["rows"] = rows_through_all_to_all(ps)
    return out
