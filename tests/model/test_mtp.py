"""Multi-token prediction (model/mtp.py) against a reference written by hand from the model's own
modules, and across layouts (TP2 with sequence parallelism, PP2) against one process.

The reference shifts the *input tokens* (Megatron-LM's roll of ``input_ids``), the model the
labels: equal ids wherever the loss mask lets them matter. A loss mask with holes exercises the
per-depth token weighting.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.helpers import reference_config, run_steps, tiny_config

MTP = dict(
    mtp_num_layers=2,
    mtp_loss_scaling_factor=0.3,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
)


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` shifted left by ``k`` along the sequence, zeros rolled in."""
    return F.pad(t[:, k:], (0, k))


def reference_objective(model, tokens, labels, mask, factor, depths):
    """main masked sum + factor / N x sum_k (depth k's token mean) x valid tokens."""
    rope = model.rope(tokens.shape[1], tokens.device)
    x = model.embedding(tokens)
    for layer in model.layers.values():
        x = layer(x, rope)
    h = model.final_norm(x)
    table = model.embedding.word_embeddings.weight
    token_loss = F.cross_entropy((h @ table.T).transpose(1, 2), labels, reduction="none")
    objective = (token_loss * mask).sum()
    for k in range(1, depths + 1):
        mtp = model.mtp.layers[k - 1]
        e = model.embedding.word_embeddings(shifted(tokens, k))
        z = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
        h = mtp.final_norm(mtp.layer(z, rope))
        mask_k = shifted(mask, k)
        loss_k = F.cross_entropy((h @ table.T).transpose(1, 2), shifted(labels, k), reduction="none")
        objective = objective + factor / depths * (loss_k * mask_k).sum() / mask_k.sum() * mask.sum()
    return objective


def test_mtp_loss_equals_the_hand_written_reference():
    cfg = tiny_config(**MTP)
    model = build_model(cfg, ParallelState.single()).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=g)
    tokens, labels = x[:, :-1], x[:, 1:]
    mask = (torch.rand(2, 16, generator=g) > 0.3).double()
    out = model(tokens=tokens, labels=labels, loss_mask=mask)
    out.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    main = model(tokens=tokens, labels=labels, loss_mask=mask).detach()
    model.zero_grad()
    reference = reference_objective(model, tokens, labels, mask, 0.3, 2)
    reference.backward()
    torch.testing.assert_close(out.detach(), main)  # the reported loss is the main model's
    assert ours.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        # fp32 rotary tables and fused loss: 1e-7 of each gradient's scale, where a wrong shift is 1e-1
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-6, atol=1e-6 * p.grad.abs().max().item(), msg=n)
    assert ours["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_the_losses_are_logged_per_depth():
    out = []
    run_steps(tiny_config(**MTP), ParallelState.single(), 1, outputs=out)
    assert len(out[0]["mtp_losses"]) == 2 and all(4.0 < v < 7.0 for v in out[0]["mtp_losses"])
    assert out[0]["mtp_losses"] != [out[0]["lm_loss"]] * 2


def test_offloading_a_layer_leaves_the_run_unchanged():
    """The depths stay on the device (they are no layer); the offloaded layer is bitwise the same."""
    kept, _ = run_steps(tiny_config(**MTP, global_batch_size=2), ParallelState.single(), 2)
    offloaded, _ = run_steps(tiny_config(**MTP, global_batch_size=2, cpu_offload_layers="1"), ParallelState.single(), 2)
    assert offloaded == kept


def test_what_the_last_stage_cannot_embed_is_refused():
    cfg = tiny_config(**{**MTP, "position_embedding_type": "learned_absolute"}, pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="the position embedding is not replicated"):
        validate(cfg, 2)
    validate(cfg.replace(pipeline_model_parallel_size=1), 1)
    validate(tiny_config(**MTP, untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=2), 2)


# ----------------------------------------------------------------------------- across layouts

LAYOUTS = {
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2_untied": dict(pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=True),
    "pp2_untied_distopt": dict(
        pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=True, use_distributed_optimizer=True
    ),
    "pp2_untied_offload": dict(
        pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=True, cpu_offload_layers="1"
    ),
    "tp2_pp2_sp_untied": dict(  # 4 ranks: the replica's lookup reduce-scattered into sequence shards
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        pipeline_model_parallel_size=2,
        untie_embeddings_and_output_weights=True,
    ),
    "pp2_interleaved_untied": dict(
        pipeline_model_parallel_size=2,
        num_layers=4,
        num_layers_per_virtual_pipeline_stage=1,
        untie_embeddings_and_output_weights=True,
    ),
    "pseudo_pp2_untied": dict(
        pipeline_model_parallel_size=2,
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="all",
        untie_embeddings_and_output_weights=True,
    ),
    "pp2_interleaved": dict(pipeline_model_parallel_size=2, num_layers=4, num_layers_per_virtual_pipeline_stage=1),
    "ep2_moe": dict(expert_model_parallel_size=2, num_experts=4, moe_ffn_hidden_size=48),
    "ep2_a2a_overlap": dict(
        expert_model_parallel_size=2, num_experts=4, moe_ffn_hidden_size=48, overlap_moe_expert_parallel_comm=True
    ),
    "pseudo_pp2": dict(pipeline_model_parallel_size=2, num_layers=4, p2r_phase="pseudo", share_pattern="all"),
}
STEPS = 2
# TP2 x PP2 with sequence parallelism sums more partial gradients in another order: its weights
# after 2 AdamW steps measured 2.9e-5 off (its gradients within 1e-5 of their scale, as the others')
WEIGHT_ATOL = {"tp2_pp2_sp_untied": 5e-5}


def _train(cfg, ps):
    out, grads = [], {}

    def keep(state):
        if not grads:
            grads.update({n: p.main_grad.clone() for n, p in state.model.named_parameters()})

    losses, state = run_steps(cfg, ps, STEPS, outputs=out, after_step=keep)
    weights = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    return losses, [o["grad_norm"] for o in out], [o["mtp_losses"] for o in out], grads, weights


def _rank(rank, world, overrides):
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.parallel.state import initialize_plan

    cfg = tiny_config(**MTP, global_batch_size=4, **overrides)
    ps = initialize_plan(ParallelPlan.for_world(cfg, world), torch.device("cpu"))
    losses, norms, mtp, grads, weights = _train(cfg, ps)
    as_numpy = lambda d: {n: t.numpy() for n, t in d.items()}  # noqa: E731 (tensors pickle by value so)
    return (ps.tp_rank, ps.tp_size, ps.ep_rank, ps.layout.ep), (losses, norms, mtp, as_numpy(grads), as_numpy(weights))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_equal_one_process(layout):
    cfg = tiny_config(**MTP, global_batch_size=4, **LAYOUTS[layout])
    one = reference_config(cfg).replace(sequence_parallel=False, overlap_moe_expert_parallel_comm=False)
    ref = _train(one, ParallelState.single())
    model = build_model(one, ParallelState.single(), meta=True)
    params = dict(model.named_parameters())
    seen = set()
    for ranks, got in run_distributed(_rank, 4 if layout.startswith("tp2_pp2") else 2, LAYOUTS[layout]):
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)  # lm loss
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=0)  # grad norm
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=0)  # per-depth losses
        for which in (3, 4):  # first step's gradients, weights after the steps
            for name, value in got[which].items():
                name = WORD_EMBEDDING if name not in params else name  # the last stage's replica (tied or not)
                if which == 3 and name == WORD_EMBEDDING and "distopt" in layout:
                    continue  # reduce-scattered over the two replicas: each main_grad sums only its own shard
                want = _shard(ref[which][name], params[name], *ranks)
                # gradients: 1e-5 of the tensor's scale (measured 6e-7); weights: 1e-5, a thousandth of an
                # AdamW step (lr 1e-2) that amplifies rounding in the gradients it normalises (measured 4e-6)
                atol = 1e-5 * want.abs().max().item() if which == 3 else WEIGHT_ATOL.get(layout, 1e-5)
                torch.testing.assert_close(torch.from_numpy(value), want, rtol=0, atol=atol, msg=f"{layout} {name}")
                seen.add(name)
    assert any(n.startswith("mtp.layers.1.") for n in seen)


def _shard(full, param, tp_rank, tp_size, ep_rank, ep_size):
    """This rank's slice of a one-process tensor (its experts, its TP shard)."""
    from megatron_p2r.parallel.sharding import tp_slice

    if getattr(param, "expert", False):
        n = full.shape[0] // ep_size
        full = full[ep_rank * n : (ep_rank + 1) * n]
    return tp_slice(full, getattr(param, "tp_dim", None), tp_rank, tp_size, getattr(param, "tp_replicas", 1))
