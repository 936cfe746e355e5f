"""What each spawned rank runs for ``test_a2a_overlap.py``: training steps with and without
--overlap-moe-expert-parallel-comm on the same data, compared bitwise inside the rank."""

from __future__ import annotations

import torch

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import Layout
from megatron_p2r.pipeline import a2a_overlap
from megatron_p2r.pipeline.p2p import deallocate_output
from megatron_p2r.pipeline.token_loss import TokenMeanLoss
from megatron_p2r.planning import activations
from tests.helpers import keep_first_step_grads, random_microbatches, run_steps
from tests.moe.workers import moe_model
from tests.pipeline.common import make_state

STEPS = 2
FULL1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# every random draw of a layer: attention and residual dropout, the router's input jitter
DRAWS = dict(hidden_dropout=0.1, attention_dropout=0.1, moe_input_jitter_eps=0.1)


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
    # both schedules draw the same random numbers from the same state (dropout, router jitter)
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
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
    return {
        "losses": losses,
        "overlapped_losses": o_losses,
        "grads_differ": sorted(n for n in grads if not torch.equal(grads[n], o_grads[n])),
        "weights_differ": sorted(n for n in weights if not torch.equal(weights[n], o_weights[n])),
        "moved": max((weights[n] - o_weights[n]).abs().max().item() for n in weights),
        "most_in_flight": record["most"],
    }


def world2(rank: int, world: int) -> dict:
    ps = make_state(Layout(dp=2, ep=2))
    common = dict(ep=2, global_batch_size=12)
    return {
        "dropless/tied": compare(moe_model(**common), ps),
        "capacity-drops/overlap-grad-reduce": compare(
            moe_model(
                **common,
                moe_capacity_factor=0.5,
                swiglu=True,
                untie_embeddings_and_output_weights=True,
                overlap_grad_reduce=True,
                ddp_bucket_size=2000,
            ),
            ps,
        ),
        "pseudo-shared/tied/overlap-grad-reduce": compare(
            moe_model(
                **common, p2r_phase="pseudo", share_pattern="all", overlap_grad_reduce=True, ddp_bucket_size=2000
            ),
            ps,
        ),
        "fp16/loss-scale": compare(moe_model(**common, fp16=True), ps),
        "dense-and-moe/recompute-selective": compare(
            moe_model(**common, moe_layer_freq=2, recompute_activations=True), ps
        ),
        # DeepSeek-style: the shared experts a node of their own, run while the dispatch is in flight
        "deepseek/shared-experts": compare(
            moe_model(
                **common,
                num_experts=8,
                moe_router_topk=4,
                moe_router_score_function="sigmoid",
                moe_router_num_groups=4,
                moe_router_group_topk=2,
                moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="seq_aux_loss",
                moe_shared_expert_intermediate_size=32,
                moe_shared_expert_gate=True,
                moe_shared_expert_overlap=True,
                disable_bias_linear=True,
                swiglu=True,
            ),
            ps,
        ),
    }


def world4(rank: int, world: int) -> dict:
    """TP=2 x EP=2 with sequence parallelism: the TP collectives inside the pieces of a layer;
    with full recomputation and dropout, also their recomputation and the model-parallel RNG
    stream (sequence-parallel dropout draws from it) replayed."""
    ps = make_state(Layout(tp=2, dp=2, ep=2))
    common = dict(tp=2, ep=2, global_batch_size=12, sequence_parallel=True, swiglu=True)
    return {
        "tp2/sequence-parallel": compare(moe_model(**common), ps),
        "tp2/sequence-parallel/full-recompute": compare(moe_model(**common, **FULL1, **DRAWS), ps),
    }


def world2_recompute(rank: int, world: int) -> dict:
    """Full recomputation, node by node in the overlapped schedule, against the serial schedule
    recomputing the same layers whole (its all-to-alls again); with every random draw on."""
    ps = make_state(Layout(dp=2, ep=2))
    common = dict(ep=2, global_batch_size=12, **DRAWS)
    return {
        "full/dropless/tied": compare(moe_model(**common, **FULL1), ps),
        "full/capacity-drops/swiglu": compare(
            moe_model(
                **common, **FULL1, moe_capacity_factor=0.5, swiglu=True, untie_embeddings_and_output_weights=True
            ),
            ps,
        ),
        "full/pseudo-shared/overlap-grad-reduce": compare(
            moe_model(
                **common,
                **FULL1,
                p2r_phase="pseudo",
                share_pattern="all",
                overlap_grad_reduce=True,
                ddp_bucket_size=2000,
            ),
            ps,
        ),
        "full/fp16/loss-scale": compare(moe_model(**common, **FULL1, fp16=True), ps),
        # M6-10T's routing: expert prototypes, top-1 in each group
        "full/prototypes": compare(
            moe_model(**common, **FULL1, num_experts=8, moe_num_prototypes=4, moe_router_topk=1), ps
        ),
        # layers 0 (MoE) and 1 (dense) recomputed, 2 (MoE) and 3 (dense) not
        "block-2/dense-and-moe": compare(
            moe_model(
                **common,
                moe_layer_freq=2,
                recompute_granularity="full",
                recompute_method="block",
                recompute_num_layers=2,
            ),
            ps,
        ),
    }


def held_after_forward(rank: int, world: int) -> dict:
    """Bytes one micro-batch's forward leaves for its backward (beyond the weights and the data),
    and the planner's count: the overlapped forward with the MoE layers recomputed node by node
    ("full") and without recomputation ("none"), and the serial forward ("serial", the flag off);
    a capacity every expert fills, as the planner's balanced routing."""
    from tests.planning.test_planner import AllocTracker

    ps = make_state(Layout(dp=2, ep=2))
    out = {}
    for name, recompute, overlapped in (("full", FULL1, True), ("none", {}, True), ("serial", {}, False)):
        cfg = moe_model(
            ep=2,
            global_batch_size=4,
            moe_capacity_factor=0.25,
            overlap_moe_expert_parallel_comm=overlapped,
            **recompute,
        )
        seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps)
        mb = random_microbatches(cfg, 1, cfg.train.micro_batch_size)[0]
        loss = TokenMeanLoss([mb], ps, 1.0)
        one = a2a_overlap.MicroBatch(model, mb, loss, a2a_overlap.SharedWeights(model))
        tracker = AllocTracker([*model.parameters(), *mb.values()])
        with tracker:
            if overlapped:
                a2a_overlap.run_pass(one.forward())
            else:
                loss_sum = loss.add(model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"]))
            tracker.held()  # collects garbage, waits for gloo to drop its buffers
            # by the storages' sizes now: a released send buffer is alive, with no bytes
            held = sum(st.nbytes() for st, allocated in list(tracker.seen.items()) if allocated)
            if overlapped:
                a2a_overlap.run_pass(one.backward())
            else:
                loss.backward(loss_sum)
        est = activations.activation_memory(cfg, ParallelPlan.build(cfg, ps.layout), 0, device_type="cpu")
        out[name] = {"held": held, "planned": est["held_per_microbatch"]}
    return out


def pp2_held_after_forward(rank: int, world: int) -> dict:
    """PP=2 x EP=2 (DP=2), 2 MoE layers per stage: bytes one micro-batch's forward on this stage
    leaves for its backward, as the combined 1F1B schedule runs it (a stage after the first
    starts from the received activation, a stage before the last frees its sent output), with
    full recomputation and without, and the planner's count for the stage."""
    from tests.planning.test_planner import AllocTracker

    ps = make_state(Layout(pp=2, dp=2, ep=2))
    out = {}
    for name, recompute in (("full", FULL1), ("none", {})):
        cfg = moe_model(
            pp=2,
            ep=2,
            global_batch_size=8,
            moe_capacity_factor=0.25,
            overlap_moe_expert_parallel_comm=True,
            **recompute,
        )
        seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps)
        mb = random_microbatches(cfg, 1, cfg.train.micro_batch_size)[0]
        shape = (cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size)
        loss = TokenMeanLoss([mb], ps, 1.0)
        tracker = AllocTracker([*model.parameters(), *mb.values()])
        with tracker:
            received = torch.randn(shape, requires_grad=True) if ps.pp_rank > 0 else None  # the p2p buffer
            one = a2a_overlap.MicroBatch(model, mb, loss, a2a_overlap.SharedWeights(model), received=received)
            a2a_overlap.run_pass(one.forward())
            if one.output is not None:  # sent to the next stage
                deallocate_output(one.output)
            del received
            tracker.held()
            held = sum(st.nbytes() for st, allocated in list(tracker.seen.items()) if allocated)
            grad = torch.randn(shape) if one.output is not None else None
            if grad is not None:
                one.output.data = grad
            a2a_overlap.run_pass(one.backward(grad))
        est = activations.activation_memory(cfg, ParallelPlan.build(cfg, ps.layout), ps.pp_rank, device_type="cpu")
        out[name] = {"held": held, "planned": est["held_per_microbatch"]}
    return out


def pp2_world4(rank: int, world: int) -> dict:
    """PP=2 x EP=2 (DP=2), 6 micro-batches per rank, 2 layers per stage: the combined 1F1B schedule
    (pipeline/a2a_pipelined.py) against the serial 1F1B one. Tied embeddings span the two
    stages (the last stage's output layer is a replica summed over the embedding group)."""
    ps = make_state(Layout(pp=2, dp=2, ep=2))
    common = dict(pp=2, ep=2, global_batch_size=24)
    return {
        "dropless/tied/dropout": compare(moe_model(**common, hidden_dropout=0.1), ps),
        "capacity-drops/untied/overlap-grad-reduce": compare(
            moe_model(
                **common,
                moe_capacity_factor=0.5,
                swiglu=True,
                untie_embeddings_and_output_weights=True,
                overlap_grad_reduce=True,
                ddp_bucket_size=2000,
            ),
            ps,
        ),
        "pseudo-shared/tied": compare(moe_model(**common, p2r_phase="pseudo", share_pattern="all"), ps),
        "fp16/loss-scale": compare(moe_model(**common, fp16=True), ps),
        "dense-and-moe/recompute-selective": compare(
            moe_model(**common, moe_layer_freq=2, recompute_activations=True), ps
        ),
        "2-microbatches": compare(moe_model(**{**common, "global_batch_size": 8}), ps),  # below stage 0's warm-up
        # full recomputation node by node (the serial 1F1B recomputes whole layers), every random draw on
        "full-recompute/dropless/tied/draws": compare(moe_model(**common, **FULL1, **DRAWS), ps),
        # v = 2 model chunks of one layer per rank, against the serial interleaved 1F1B
        "interleaved/dropless/tied/dropout": compare(
            moe_model(**common, num_layers_per_virtual_pipeline_stage=1, hidden_dropout=0.1), ps
        ),
        "interleaved/pseudo-shared/overlap-grad-reduce": compare(
            moe_model(
                **common,
                num_layers_per_virtual_pipeline_stage=1,
                p2r_phase="pseudo",
                share_pattern="all",
                overlap_grad_reduce=True,
                ddp_bucket_size=2000,
            ),
            ps,
        ),
    }
