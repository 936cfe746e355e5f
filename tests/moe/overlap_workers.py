"""What each spawned rank runs for ``test_a2a_overlap.py``: training steps with and without
--overlap-moe-expert-parallel-comm on the same data, compared bitwise inside the rank."""
from __future__ import annotations

import torch

from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import Layout
from megatron_p2r.pipeline import a2a_overlap
from tests.helpers import keep_first_step_grads, run_steps
from tests.moe.workers import moe_model
from tests.pipeline.common import make_state

STEPS = 2


def _counting_all_to_alls(record: dict):
    """``start_all_to_all`` that records the most all-to-alls in flight at once."""
    original = a2a_overlap.start_all_to_all

    def start(*args, **kwargs):
        out, wait = original(*args, **kwargs)
        record["now"] += 1
        record["most"] = max(record["most"], record["now"])

        def counted_wait():
            wait()
            record["now"] -= 1
        return out, counted_wait
    return start


def _steps(cfg, ps):
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)   # both runs draw the same dropout masks
    grads = {}
    losses, state = run_steps(cfg, ps, STEPS, after_step=keep_first_step_grads(grads))
    # each backward the data-parallel hooks saw start (--overlap-grad-reduce starts the buckets in the last)
    grads["backwards seen by the hooks"] = torch.tensor(state.ddp._backwards.get(0, 0))
    return losses, grads, {n: p.detach().clone() for n, p in state.model.named_parameters()}


def compare(cfg, ps) -> dict:
    """Losses, first-step gradients and weights after the steps: serial vs overlapped."""
    losses, grads, weights = _steps(cfg, ps)
    record, original = {"now": 0, "most": 0}, a2a_overlap.start_all_to_all
    a2a_overlap.start_all_to_all = _counting_all_to_alls(record)
    try:
        o_losses, o_grads, o_weights = _steps(cfg.replace(overlap_moe_expert_parallel_comm=True), ps)
    finally:
        a2a_overlap.start_all_to_all = original
    return {"losses": losses, "overlapped_losses": o_losses,
            "grads_differ": sorted(n for n in grads if not torch.equal(grads[n], o_grads[n])),
            "weights_differ": sorted(n for n in weights if not torch.equal(weights[n], o_weights[n])),
            "moved": max((weights[n] - o_weights[n]).abs().max().item() for n in weights),
            "most_in_flight": record["most"]}


def world2(rank: int, world: int) -> dict:
    ps = make_state(Layout(dp=2, ep=2))
    common = dict(ep=2, global_batch_size=12)
    return {
        "dropless/tied": compare(moe_model(**common), ps),
        "capacity-drops/overlap-grad-reduce": compare(moe_model(**common, moe_capacity_factor=0.5, swiglu=True,
                                                                untie_embeddings_and_output_weights=True,
                                                                overlap_grad_reduce=True, ddp_bucket_size=2000), ps),
        "pseudo-shared/tied/overlap-grad-reduce": compare(moe_model(**common, p2r_phase="pseudo", share_pattern="all",
                                                                    overlap_grad_reduce=True, ddp_bucket_size=2000), ps),
        "fp16/loss-scale": compare(moe_model(**common, fp16=True), ps),
        "dense-and-moe/recompute-selective": compare(moe_model(**common, moe_layer_freq=2,
                                                               recompute_activations=True), ps),
    }


def world4(rank: int, world: int) -> dict:
    """TP=2 x EP=2 with sequence parallelism: the TP collectives inside the pieces of a layer."""
    ps = make_state(Layout(tp=2, dp=2, ep=2))
    return {"tp2/sequence-parallel": compare(moe_model(tp=2, ep=2, global_batch_size=12, sequence_parallel=True,
                                                       swiglu=True), ps)}


def pp2_world4(rank: int, world: int) -> dict:
    """PP=2 x EP=2 (DP=2), 6 micro-batches per rank, 2 layers per stage: the combined 1F1B schedule
    (pipeline/a2a_pipelined.py) against the serial 1F1B one. Tied embeddings span the two
    stages (the last stage's output layer is a replica summed over the embedding group)."""
    ps = make_state(Layout(pp=2, dp=2, ep=2))
    common = dict(pp=2, ep=2, global_batch_size=24)
    return {
        "dropless/tied/dropout": compare(moe_model(**common, hidden_dropout=0.1), ps),
        "capacity-drops/untied/overlap-grad-reduce": compare(
            moe_model(**common, moe_capacity_factor=0.5, swiglu=True, untie_embeddings_and_output_weights=True,
                      overlap_grad_reduce=True, ddp_bucket_size=2000), ps),
        "pseudo-shared/tied": compare(moe_model(**common, p2r_phase="pseudo", share_pattern="all"), ps),
        "fp16/loss-scale": compare(moe_model(**common, fp16=True), ps),
        "dense-and-moe/recompute-selective": compare(moe_model(**common, moe_layer_freq=2,
                                                               recompute_activations=True), ps),
        "2-microbatches": compare(moe_model(**{**common, "global_batch_size": 8}), ps),   # below stage 0's warm-up
        # v = 2 model chunks of one layer per rank, against the serial interleaved 1F1B
        "interleaved/dropless/tied/dropout": compare(moe_model(**common, num_layers_per_virtual_pipeline_stage=1,
                                                               hidden_dropout=0.1), ps),
        "interleaved/pseudo-shared/overlap-grad-reduce": compare(
            moe_model(**common, num_layers_per_virtual_pipeline_stage=1, p2r_phase="pseudo", share_pattern="all",
                      overlap_grad_reduce=True, ddp_bucket_size=2000), ps),
    }
