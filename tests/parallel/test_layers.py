"""TP=2 and TP=4 reproduce TP=1: loss and every gradient shard after one step, and losses
over 3 optimizer steps, for a GPT-style and a Llama-style configuration.

Tolerance: fp32; TP changes only the order of reductions, so gradients agree to 2e-5
absolute (values are O(1e-2..1)) and losses to 1e-5 relative.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import get_rng_tracker
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from megatron_p2r.testing import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import max_grad_error, random_microbatches, reference_config, reference_grads, run_steps, tiny_config

VARIANTS = {
    "gpt": {},
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True),
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
    out["dropout"] = _dropout_consistency(world)
    return out


def _dropout_consistency(world):
    """Replicated activations get identical dropout masks on TP peers; split ones do not."""
    cfg = tiny_config(tensor_model_parallel_size=world, hidden_dropout=0.3, attention_dropout=0.3)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    model = build_model(cfg, ps)
    captured = {}
    model.final_norm.register_forward_hook(lambda m, inp, out: captured.setdefault("x", inp[0].detach()))
    model(tokens=random_microbatches(cfg, 1, 2)[0]["tokens"])
    hidden = [torch.empty_like(captured["x"]) for _ in range(world)]
    dist.all_gather(hidden, captured["x"], group=ps.group("tp"))
    with get_rng_tracker(ps.device).fork():
        draw = torch.rand(8)
    draws = [torch.empty_like(draw) for _ in range(world)]
    dist.all_gather(draws, draw, group=ps.group("tp"))
    return (all(torch.equal(hidden[0], h) for h in hidden[1:]),
            all(not torch.equal(draws[0], d) for d in draws[1:]))


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_reproduces_single_process(world):
    for rank_out in run_distributed(_tp_equivalence, world):
        for variant in VARIANTS:
            loss, ref_loss, errors, losses, ref_losses = rank_out[variant]
            assert loss == pytest.approx(ref_loss, rel=1e-5), variant
            worst = max(errors, key=errors.get)
            assert errors[worst] < 2e-5, (variant, worst, errors[worst])
            assert losses == pytest.approx(ref_losses, rel=1e-5), variant
        same_replicated, different_split = rank_out["dropout"]
        assert same_replicated and different_split
