"""Multi-latent attention (--multi-latent-attention) under tensor and sequence parallelism.

TP2 and TP2 with sequence parallelism reproduce the one-process model: the loss and every
gradient shard of one step (with the plan's reductions: the replicated down-projections and
latent norms get whole gradients without SP, partial ones summed over TP with it), then the losses,
grad norms and every weight after 2 optimizer steps. Tolerances as tests/model/test_attention.py
(fp32, TP changes only the order of reductions). The down-projection replicas stay bitwise equal
over the TP ranks. Transformers' DeepSeek-V3 pins the arithmetic itself
(tests/convert/hf/test_deepseek_v3.py); the options MLA refuses are named.
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.model.latent_attention import softmax_scale
from megatron_p2r.model.yarn import yarn_inv_freq, yarn_mscale
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import setup_parallel
from tests.harness import run_distributed
from tests.helpers import expected_shard, reference_config, run_steps, tiny_config
from tests.pipeline.common import compare_case

MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_head_dim=6,
    qk_pos_emb_head_dim=4,
    v_head_dim=5,
    qk_layernorm=True,
    rotary_scaling_factor=4.0,
    mscale_all_dim=0.8,
)
CASES = {
    # rotary, RMSNorm latents, SwiGLU, the core recomputed
    "tp2": dict(
        MLA,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        recompute_activations=True,
    ),
    # no query latent (q_proj), LayerNorm latents (weight and bias), learned positions beside MLA's rotary
    "tp2_sp": dict(MLA, q_lora_rank=None, sequence_parallel=True),
}


def _weights_error(model, ps, reference) -> float:
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    return max((p.detach() - expected_shard(ref[n], p, ps)).abs().max().item() for n, p in model.named_parameters())


def _replica_digests(model, ps) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if "down_proj" in name or "layernorm" in name:
            mine = hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
            everyone = [None] * ps.tp_size
            dist.all_gather_object(everyone, mine, group=ps.group("tp"))
            out[name] = everyone
    return out


def _rank(rank, world):
    out = {}
    for name, options in CASES.items():
        cfg = tiny_config(tensor_model_parallel_size=2, global_batch_size=4, **options)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        case = compare_case(cfg, ps.layout, ps, "1f1b", n_micro=2)
        steps, ref_steps = [], []
        losses, state = run_steps(cfg, ps, 2, outputs=steps)
        ref_losses, ref_state = run_steps(reference_config(cfg), ParallelState.single(), 2, outputs=ref_steps)
        out[name] = dict(
            loss_err=case["loss_err"],
            grad_err=case["grad_err"],
            losses=losses,
            ref_losses=ref_losses,
            norms=[s["grad_norm"] for s in steps],
            ref_norms=[s["grad_norm"] for s in ref_steps],
            weights_err=_weights_error(state.model, ps, ref_state.model),
            replicas=_replica_digests(state.model, ps),
        )
    return out


def test_tp2_and_sequence_parallel_reproduce_one_process():
    for r in run_distributed(_rank, 2, timeout=600):
        for name, res in r.items():
            assert res["loss_err"] < 1e-5 and res["grad_err"] < 2e-5, (name, res)
            assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5), name
            assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5), name
            assert res["weights_err"] < 1e-5, (name, res["weights_err"])
            assert res["replicas"], name
            for tensor, copies in res["replicas"].items():
                assert len(set(copies)) == 1, (name, tensor)


# ----------------------------------------------------------------------------- one process


def test_yarn_and_softmax_scale_follow_deepseek_v3():
    """factor 1 is plain rotary; the slow dimensions are divided by the factor, the fast kept; the
    softmax scale is mscale(factor, mscale_all_dim)^2 / sqrt(q head dim)."""
    plain = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(yarn_inv_freq(64, 10000.0, 1.0, 4096, 32.0, 1.0, True), plain, rtol=1e-6, atol=0)
    scaled = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32.0, 1.0, True)
    assert torch.allclose(scaled[:5], plain[:5], rtol=1e-6, atol=0) and torch.allclose(scaled[-5:], plain[-5:] / 40)
    assert yarn_mscale(1.0, 5.0) == 1.0 and yarn_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * 3.6888794541139363)
    m = tiny_config(**MLA).model
    assert softmax_scale(m) == pytest.approx((1 + 0.08 * 1.3862943611198906) ** 2 / 10**0.5)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(group_query_attention=True), "--group-query-attention is refused with --multi-latent-attention"),
        (dict(window_size="4,0"), "--window-size is refused with --multi-latent-attention"),
        (dict(softmax_type="learnable"), "--softmax-type is refused"),
        (dict(add_qkv_bias=True), "--add-qkv-bias is refused"),
        (dict(qk_pos_emb_head_dim=5), "--qk-pos-emb-head-dim \\(5\\) must be even"),
    ],
)
def test_what_mla_refuses_is_named(options, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**{**MLA, **options}), 1)
