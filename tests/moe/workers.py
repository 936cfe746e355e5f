"""What each spawned rank runs for the expert-parallel tests: one spawn per world size (2 and
4 ranks), many cases per spawn. Every case returns plain numbers (errors against the
one-process reference computed inside the rank, token counts); ``test_expert_parallel.py``
asserts on them. No pytest import here: ranks start faster.

Layer cases: each DP rank feeds its own inputs (different token counts) through one MoE layer;
the reference feeds all ranks' inputs through the one-process layer (same seed: initialisation
is layout-invariant), loss = mean over all inputs of sum(out * g). The layer is layer 0's MLP
of a model built as training builds it, so its gradients are those the DDP reduces.
Model cases: a whole M6 model step (``tests.pipeline.common.compare_case``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
import torch.distributed as dist

from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.training import pretrain
from tests.helpers import expected_shard
from tests.moe.common import (
    bias_router_towards,
    build_layer,
    force_first_experts,
    layer_cfg,
    layer_grads,
    layer_inputs,
    layer_with_grad_buffers,
    random_biases,
    run_layer,
)
from tests.pipeline.common import make_cfg, make_state, reference
from tests.pipeline.workers import equivalence_cases, train_replicas

PER_RANK = 2  # layer inputs (micro-batches) per DP rank


def _both(*modifiers):
    def modify(layer, ps):
        for m in modifiers:
            m(layer, ps)

    return modify


@contextlib.contextmanager
def counting_grouped_mm():
    """The number of grouped_mm calls inside the block."""
    calls, original = [], F.grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    F.grouped_mm = counting
    try:
        yield calls
    finally:
        F.grouped_mm = original


def padded_reference(cfg, microbatches):
    """The one-process model with the padded experts."""
    return reference(cfg.replace(moe_grouped_gemm=False), microbatches)


def grouped_model_cases(ps: ParallelState, layout: Layout, cases) -> dict:
    """Model steps [(label, cfg, micro-batches)] with --moe-grouped-gemm against the one-process
    model with the padded experts."""
    return equivalence_cases(
        ps,
        layout,
        [(label, cfg.replace(moe_grouped_gemm=True), "1f1b", n) for label, cfg, n in cases],
        reference_fn=padded_reference,
    )


def layer_case(ps: ParallelState, overrides: dict, modify=None, transform=None, seed: int = 0) -> dict:
    """The reference layer always has the padded experts: the grouped/ cases compare grouped_mm
    under EP/TP with padded bmm on one process; and never pads to capacity: a padded case is
    compared with the unpadded layer (the same math)."""
    inputs = layer_inputs(PER_RANK * ps.dp_size, seed)
    if transform is not None:
        inputs = [(transform(x), g) for x, g in inputs]
    mine = inputs[ps.dp_rank * PER_RANK : (ps.dp_rank + 1) * PER_RANK]

    layer, ddp, cfg = layer_with_grad_buffers(overrides, ps, modify)
    received = []
    layer.experts.register_forward_pre_hook(lambda mod, args: received.append(sum(args[1])))
    with counting_grouped_mm() as grouped_calls:
        outs = run_layer(layer, mine)
    raw = layer_grads(layer)  # this rank's own sums, before the DDP reduces them
    ddp.finish_grad_sync()

    unpadded = dataclasses.replace(cfg, moe_grouped_gemm=False, moe_pad_expert_input_to_capacity=False)
    ref_layer = build_layer(unpadded, ParallelState.single(), modify=modify)
    ref_outs = run_layer(ref_layer, inputs)
    ref_grads = layer_grads(ref_layer)
    ref_mine = ref_outs[ps.dp_rank * PER_RANK : (ps.dp_rank + 1) * PER_RANK]

    result = {
        "out_err": max((o - r).abs().max().item() for o, r in zip(outs, ref_mine, strict=True)),
        "grad_err": {},
        "received": sum(received),
        "grouped_mm_calls": len(grouped_calls),
        "wrong_group_err": None,
        "wrong_divisor_err": None,
    }
    params = dict(layer.named_parameters())
    for n, p in params.items():
        want = expected_shard(ref_grads[n], p, ps)
        result["grad_err"][n] = (p.main_grad - want).abs().max().item()
    result["expert_grad_nonzero"] = bool(torch.count_nonzero(params["experts.weight1"].main_grad) > 0)
    # The same raw gradients reduced the wrong ways: over the whole dp group (mixing different
    # experts that share a local slot), and divided by expert-dp instead of dp.
    w1 = raw["experts.weight1"]
    want = expected_shard(ref_grads["experts.weight1"], params["experts.weight1"], ps)
    if ps.group("dp") is not None:
        wrong = w1.clone()
        dist.all_reduce(wrong, group=ps.group("dp"))
        result["wrong_group_err"] = (wrong / ps.dp_size - want).abs().max().item()
        wrong = w1.clone()
        if ps.group("expert_dp") is not None:
            dist.all_reduce(wrong, group=ps.group("expert_dp"))
        result["wrong_divisor_err"] = (wrong / ps.expert_dp_size - want).abs().max().item()
    return result


LAYER_CASES = {
    "top2/dropless": (dict(moe_router_topk=2), None, None),
    "top1/capacity-no-drop": (dict(moe_router_topk=1, moe_capacity_factor=8.0), None, None),
    "top2/capacity-drops": (dict(moe_router_topk=2, moe_capacity_factor=0.5), None, None),
    "top2/capacity-drops/position": (
        dict(moe_router_topk=2, moe_capacity_factor=0.5, moe_token_drop_policy="position"),
        None,
        None,
    ),
    "top2/capacity-padded": (  # zero rows to capacity cross the all-to-alls and come back
        dict(moe_router_topk=2, moe_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True),
        random_biases,
        None,
    ),
    "prototypes": (
        dict(num_experts=8, moe_num_prototypes=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
        None,
        None,
    ),
    "swiglu-bias": (dict(moe_router_topk=2, swiglu=True), random_biases, None),
    "grouped/top2/dropless": (dict(moe_router_topk=2, moe_grouped_gemm=True), None, None),
    "grouped/top2/capacity-drops": (
        dict(moe_router_topk=2, moe_capacity_factor=0.5, moe_grouped_gemm=True),
        None,
        None,
    ),
    "grouped/swiglu-bias": (dict(moe_router_topk=2, swiglu=True, moe_grouped_gemm=True), random_biases, None),
}


def layer_cases(ps: ParallelState, prefix: str, names=None) -> dict:
    out = {}
    for name, (overrides, modify, transform) in LAYER_CASES.items():
        if names is None or name in names:
            out[f"{prefix}/{name}"] = layer_case(ps, overrides, modify, transform)
    return out


def zero_token_case(ps: ParallelState, **overrides) -> dict:
    """Every token prefers the experts of EP rank 0: the other ranks' experts get no rows."""
    first = 4 // ps.ep_size
    return layer_case(
        ps,
        dict(moe_router_topk=first, **overrides),
        _both(random_biases, bias_router_towards(first)),
        force_first_experts,
    )


def sent_dtypes_under_bf16(ps: ParallelState) -> list:
    """dtypes of the row tensors the all-to-alls carry, forward and backward, with bf16 weights
    and activations as --bf16 trains (split sizes are int64 and not counted)."""
    from megatron_p2r.parallel import mappings

    layer = build_layer(layer_cfg(moe_router_topk=2), ps).to(torch.bfloat16)
    x, g = layer_inputs(2)[ps.dp_rank]
    x = x.to(torch.bfloat16).requires_grad_()  # so the dispatch all-to-all has a backward too
    seen, original = [], mappings._all_to_all_single

    def recording(t, *args):
        if t.is_floating_point():
            seen.append(str(t.dtype))
        return original(t, *args)

    mappings._all_to_all_single = recording
    try:
        (layer(x).float() * g).sum().backward()
    finally:
        mappings._all_to_all_single = original
    return seen


def moe_model(tp: int = 1, pp: int = 1, ep: int = 1, **overrides):
    values = dict(
        num_experts=4,
        expert_model_parallel_size=ep,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
    )
    values.update(overrides)
    return make_cfg(tp=tp, pp=pp, **values)


def world2(rank: int, world: int, log_file: str) -> dict:
    """EP=2 (DP=2); also 3 optimizer steps against one process, and ``pretrain`` writing its log."""
    layout = Layout(dp=2, ep=2)
    ps = make_state(layout)
    out = {"layer": layer_cases(ps, "ep2"), "model": {}}
    out["layer"]["ep2/zero-tokens"] = zero_token_case(ps)
    out["layer"]["ep2/grouped/zero-tokens"] = zero_token_case(ps, moe_grouped_gemm=True)
    out["bf16_rows"] = sent_dtypes_under_bf16(ps)
    out["model"].update(
        equivalence_cases(
            ps,
            layout,
            [
                ("ep2/dropless", moe_model(ep=2), "1f1b", 2),
                ("ep2/capacity-no-drop", moe_model(ep=2, moe_capacity_factor=8.0, moe_router_topk=1), "1f1b", 2),
                ("ep2/capacity-drops", moe_model(ep=2, moe_capacity_factor=0.5, swiglu=True), "1f1b", 1),
                (
                    "ep2/prototypes-recompute",
                    moe_model(ep=2, num_experts=8, moe_num_prototypes=4, moe_router_topk=1, recompute_activations=True),
                    "1f1b",
                    2,
                ),
            ],
        )
    )
    out["bf16"] = equivalence_cases(
        ps, layout, [("ep2/bf16-recompute", moe_model(ep=2, recompute_activations=True, bf16=True), "1f1b", 2)]
    )
    with counting_grouped_mm() as calls:
        out["model"].update(
            grouped_model_cases(
                ps, layout, [("ep2/grouped/capacity-drops", moe_model(ep=2, moe_capacity_factor=0.5, swiglu=True), 1)]
            )
        )
        out["bf16"].update(
            grouped_model_cases(
                ps, layout, [("ep2/grouped/bf16-recompute", moe_model(ep=2, recompute_activations=True, bf16=True), 2)]
            )
        )
    out["grouped_model_calls"] = len(calls)
    out["train"] = train_replicas(moe_model(ep=2, global_batch_size=8, moe_capacity_factor=1.0), ps)
    pretrain(moe_model(ep=2, train_iters=2, moe_capacity_factor=0.5, log_file=log_file))
    return out


def world4(rank: int, world: int) -> dict:
    """EP=4 (DP=4); EP=2 x expert-DP=2 (DP=4); TP=2 x EP=2; PP=2 x EP=2."""
    out = {"layer": {}, "model": {}}
    layout = Layout(dp=4, ep=4)
    ps = make_state(layout)
    out["layer"].update(layer_cases(ps, "ep4", names=("top2/dropless", "top1/capacity-no-drop", "top2/capacity-drops")))
    out["layer"]["ep4/zero-tokens"] = zero_token_case(ps)
    out["model"].update(
        equivalence_cases(
            ps,
            layout,
            [
                ("ep4/dropless", moe_model(ep=4), "1f1b", 1),
                ("ep4/capacity-no-drop", moe_model(ep=4, moe_capacity_factor=8.0), "1f1b", 1),
            ],
        )
    )

    layout = Layout(dp=4, ep=2)
    ps = make_state(layout)
    out["layer"].update(layer_cases(ps, "ep2xedp2", names=("top2/dropless", "swiglu-bias")))
    out["model"].update(equivalence_cases(ps, layout, [("ep2xedp2/dropless", moe_model(ep=2), "1f1b", 1)]))

    layout = Layout(tp=2, dp=2, ep=2)
    ps = make_state(layout)
    out["layer"].update(layer_cases(ps, "tp2ep2"))
    out["model"].update(
        equivalence_cases(
            ps,
            layout,
            [
                ("tp2ep2/dropless-swiglu", moe_model(tp=2, ep=2, swiglu=True), "1f1b", 1),
                ("tp2ep2/capacity-drops", moe_model(tp=2, ep=2, moe_capacity_factor=0.5), "1f1b", 1),
            ],
        )
    )
    with counting_grouped_mm() as calls:
        out["model"].update(
            grouped_model_cases(ps, layout, [("tp2ep2/grouped/dropless-swiglu", moe_model(tp=2, ep=2, swiglu=True), 1)])
        )
    out["grouped_model_calls"] = len(calls)

    layout = Layout(pp=2, dp=2, ep=2)
    ps = make_state(layout)
    out["model"].update(
        equivalence_cases(
            ps,
            layout,
            [
                ("pp2ep2/dropless/1f1b", moe_model(pp=2, ep=2, moe_layer_freq=2), "1f1b", 2),
                ("pp2ep2/capacity-drops/1f1b", moe_model(pp=2, ep=2, moe_capacity_factor=0.5), "1f1b", 2),
            ],
        )
    )
    return out
