"""Pseudo phase under pipeline and tensor parallelism.

A slot used on several stages exists once per stage; its gradient is summed over those
stages (and averaged over DP) by one all-reduce, so a PP pseudo run reproduces the PP=1
pseudo run, and replicas stay bitwise identical step after step.
Covers dense and MoE layers (experts under EP=2 and TP=2, share-pattern all giving one dense and
one MoE module), and grouped-query attention with its one key/value head replicated over TP=2. Tolerance: fp32, 2e-5 absolute on gradients (reduction order only), 1e-5 on the loss.
"""

import hashlib

import torch
import torch.distributed as dist

from megatron_p2r.parallel.sharding import logical_name
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import run_steps
from tests.pipeline.common import compare_case, make_cfg

MOE = dict(num_experts=4, moe_layer_freq=2, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)
CASES = {  # name: (tp, pp, pattern, schedule, overrides) on 4 ranks (DP fills the rest)
    "pp4_all_1f1b": (1, 4, "all", "1f1b", {}),
    "pp2_dp2_cycle2_gpipe": (1, 2, "cycle:2", "gpipe", {}),
    "tp2_pp2_all_1f1b": (2, 2, "all", "1f1b", {}),
    "pp2_dp2_block2_1f1b": (1, 2, "block:2", "1f1b", {}),
    "moe_pp2_dp2_ep2_all": (1, 2, "all", "1f1b", dict(MOE, expert_model_parallel_size=2)),
    "moe_tp2_pp2_all": (2, 2, "all", "1f1b", MOE),
    # one key/value head replicated on both TP ranks of a slot held by both stages: its
    # gradient is summed over "TP block x stages x DP" in one all-reduce
    "gqa_tp2_pp2_all": (2, 2, "all", "1f1b", dict(group_query_attention=True, num_query_groups=1, qk_layernorm=True)),
}


def _checksums(model, plan) -> dict:
    return {
        logical_name(n, p): hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
        if plan.replica_stages(logical_name(n, p))
    }


def _pseudo_rank(rank, world):
    out = {}
    for name, (tp, pp, pattern, schedule, overrides) in CASES.items():
        cfg = make_cfg(tp=tp, pp=pp, p2r_phase="pseudo", share_pattern=pattern, **overrides)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        case = compare_case(cfg, ps.layout, ps, schedule, n_micro=3)
        out[name] = {"loss_err": case["loss_err"], "grad_err": case["grad_err"], "names": case["names"]}
    # Replicas after 5 optimizer steps: gather every rank's checksums of stage-shared tensors.
    cfg = make_cfg(tp=1, pp=2, p2r_phase="pseudo", share_pattern="all", global_batch_size=8)
    ps, plan = setup_parallel(cfg, torch.device("cpu"))
    _, state = run_steps(cfg, ps, 5)
    sums = [None] * world
    dist.all_gather_object(sums, (ps.pp_rank, ps.dp_rank, _checksums(state.model, plan)))
    out["replicas"] = sums
    return out


def test_pseudo_pipeline_reproduces_single_stage_and_replicas_stay_identical():
    results = run_distributed(_pseudo_rank, 4, timeout=400)
    for name in CASES:
        for r in results:
            assert r[name]["loss_err"] < 1e-5, name
            assert r[name]["grad_err"] < 2e-5, name
    # share-pattern all with MoE in every other layer: one dense and one MoE module (keys 0 and 1)
    moe_modules = {
        n.split(".")[1] for r in results for n in r["moe_pp2_dp2_ep2_all"]["names"] if n.startswith("layers.")
    }
    assert moe_modules == {"0", "1"}
    assert any(".mlp.experts." in n for n in results[0]["moe_pp2_dp2_ep2_all"]["names"])
    replicas = results[0]["replicas"]
    by_name = {}
    for stage, dp, sums in replicas:
        for tensor, digest in sums.items():
            by_name.setdefault(tensor, set()).add(digest)
    assert any(t.startswith("layers.0.") for t in by_name)  # the shared slot is among them
    assert "embedding.word_embeddings.weight" in by_name
    for tensor, digests in by_name.items():
        assert len(digests) == 1, f"{tensor}: replicas differ across stages/DP after 5 steps"
    stages_holding_slot = {stage for stage, _, sums in replicas if "layers.0.attention.qkv.weight" in sums}
    assert stages_holding_slot == {0, 1}
