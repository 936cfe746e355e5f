"""TP=2 and TP=4 reproduce TP=1: loss and every gradient shard after one step, and losses
over 3 optimizer steps, for a GPT-style and a Llama-style configuration; attention dropout
draws each rank's masks from its own TP stream.

Tolerance: fp32; TP changes only the order of reductions, so gradients agree to 2e-5
absolute (values are O(1e-2..1)) and losses to 1e-5 relative.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import get_rng_tracker, seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import max_grad_error, random_microbatches, reference_config, reference_grads, run_steps, tiny_config

VARIANTS = {
    "gpt": {},
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
    ),
}


def _tp_equivalence(rank, world):
    out = {}
    for variant, overrides in VARIANTS.items():
        cfg = tiny_config(tensor_model_parallel_size=world, global_batch_size=4, **overrides)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        mbs = random_microbatches(cfg, 2, 2)
        ref_loss, ref_grads = reference_grads(cfg, mbs)
        model = build_model(cfg, ps)
        loss = forward_backward_no_pipelining(model, mbs, ps).item()
        errors = max_grad_error(model, ps, ref_grads)
        losses, _ = run_steps(cfg, ps, 3)
        ref_losses, _ = run_steps(reference_config(cfg), ParallelState.single(), 3)
        out[variant] = (loss, ref_loss, errors, losses, ref_losses)
    out["dropout"] = _dropout_streams(world)
    return out


def _keep_mask(shape, p: float) -> torch.Tensor:
    """The attention-dropout keep mask [b, heads, s, s] (causal part) that SDPA draws at the
    current RNG state for q/k/v of ``shape`` (advancing the state as that call would): with
    q = k = 0 and v = identity the output is the kept, rescaled uniform causal weights."""
    b, h, s, d = shape
    zeros = torch.zeros(shape)
    v = torch.eye(s, d).expand(b, h, s, d)
    out = F.scaled_dot_product_attention(zeros, zeros, v, dropout_p=p, is_causal=True)
    return out[..., :s] > 0


def _attention_by_hand(q, k, v, keep, p: float) -> torch.Tensor:
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) * keep / (1 - p)) @ v


def _dropout_streams(world):
    """TP ranks run the model with attention and hidden dropout; every attention call's keep
    mask is read back from the RNG state it ran at. Returns whether the replicated hidden
    states agree over TP, the largest error of the read-back masks against the kernel's own
    output, whether the masks match the ones this rank's model-parallel stream draws (seeded
    as training seeds it), and whether they differ between TP ranks."""
    cfg = tiny_config(tensor_model_parallel_size=world, hidden_size=64, hidden_dropout=0.3, attention_dropout=0.5)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    model, p = build_model(cfg, ps), cfg.model.attention_dropout
    captured, calls = {}, []
    model.final_norm.register_forward_hook(lambda m, inp, out: captured.setdefault("x", inp[0].detach()))
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((torch.get_rng_state(), q.detach(), k.detach(), v.detach()))
        return sdpa(q, k, v, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        model(tokens=random_microbatches(cfg, 1, 2)[0]["tokens"])
    finally:
        F.scaled_dot_product_attention = sdpa
    masks, kernel_err = [], 0.0
    for state, q, k, v in calls:
        torch.set_rng_state(state)
        masks.append(_keep_mask(q.shape, p))
        torch.set_rng_state(state)
        kernel = sdpa(q, k, v, dropout_p=p, is_causal=True)
        kernel_err = max(kernel_err, (kernel - _attention_by_hand(q, k, v, masks[-1], p)).abs().max().item())
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)  # the streams as training starts them
    with get_rng_tracker(ps.device).fork():
        stream = [_keep_mask(q.shape, p) for _, q, _, _ in calls]
    hidden = [torch.empty_like(captured["x"]) for _ in range(world)]
    dist.all_gather(hidden, captured["x"], group=ps.group("tp"))
    first = [torch.empty_like(masks[0]) for _ in range(world)]
    dist.all_gather(first, masks[0], group=ps.group("tp"))
    return {
        "same_hidden": all(torch.equal(hidden[0], h) for h in hidden[1:]),
        "kernel_err": kernel_err,
        "calls": len(calls),
        "from_stream": all(torch.equal(m, r) for m, r in zip(masks, stream, strict=True)),
        "differ_over_tp": all(not torch.equal(first[i], first[j]) for i in range(world) for j in range(i)),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_ranks(request):
    """What every rank of a TP=2 / TP=4 job reports (one spawn for both tests)."""
    return run_distributed(_tp_equivalence, request.param)


def test_tensor_parallel_reproduces_single_process(tp_ranks):
    for rank_out in tp_ranks:
        for variant in VARIANTS:
            loss, ref_loss, errors, losses, ref_losses = rank_out[variant]
            assert loss == pytest.approx(ref_loss, rel=1e-5), variant
            worst = max(errors, key=errors.get)
            assert errors[worst] < 2e-5, (variant, worst, errors[worst])
            assert losses == pytest.approx(ref_losses, rel=1e-5), variant


def test_attention_dropout_draws_from_each_tp_ranks_own_stream(tp_ranks):
    """Heads are split over TP, so each rank's attention-dropout masks must come from its
    model-parallel RNG stream (seed + 2718 + tp rank): they equal the masks that stream
    draws, and differ between TP ranks -- while the replicated residual stream (hidden
    dropout on the default stream, the same on TP peers) stays identical over TP. The masks
    are read back exactly (checked against SDPA's own output, fp32 1e-6)."""
    for rank_out in tp_ranks:
        d = rank_out["dropout"]
        assert d["calls"] == 2 and d["kernel_err"] < 1e-6, d
        assert d["same_hidden"] and d["from_stream"] and d["differ_over_tp"], d
