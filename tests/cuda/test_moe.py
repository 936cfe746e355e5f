"""MoE on CUDA: the dispatcher's all-to-alls through NCCL (a one-rank ep group), and the experts
through ``grouped_mm`` (``--moe-grouped-gemm``), each against the same run on CPU.
Tolerances: ``tests/cuda/compare.py``."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_p2r.moe import grouped_mm  # noqa: E402
from megatron_p2r.parallel import mappings  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from tests.cuda.compare import (
    assert_16bit_close,
    count_calls,
    cpu_run,
    grad_errors,
    relative,  # noqa: E402
    train,
)
from tests.cuda.test_numerics import SHAPE  # noqa: E402

pytestmark = pytest.mark.cuda

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def test_moe_forward_backward_through_nccl_all_to_all(lane, record_property, monkeypatch):
    """EP=1 has no ep group, so the dispatcher would skip communication; giving the model a
    one-rank ep group makes it run the real path — the count exchange and the row all-to-all,
    forward and backward — through ``dist.all_to_all_single`` on NCCL, asynchronously
    (``mappings.start_all_to_all``: the handle the overlapped schedules wait on; gloo has none:
    there the dispatcher's all-to-alls are send/recv, none of them to another rank). A one-rank
    all-to-all is a copy, so losses and gradients must equal the group-less run bitwise, and
    the CPU fp32 reference within fp32 tolerance."""
    values = {**SHAPE, **MOE}
    cfg = lane.config(values)
    dispatched, native = (
        count_calls(monkeypatch, mappings, "_all_to_all_single"),
        count_calls(monkeypatch, dist, "all_to_all_single", keep=lambda args, work: work),
    )
    plain_losses, plain_grads, _ = train(cfg, lane.parallel(cfg), 2)
    assert not dispatched, "the group-less run (EP=1) must not communicate"
    ps = lane.parallel(cfg)
    with_group = ParallelState(
        layout=ps.layout, rank=ps.rank, device=ps.device, groups={**ps.groups, "ep": dist.new_group([0])}
    )
    losses, grads, _ = train(cfg, with_group, 2)
    ref_losses, ref_grads, _ = cpu_run(values, 2)
    record_property("backend", dist.get_backend(with_group.groups["ep"]))
    record_property("all_to_alls", {"dispatcher": len(dispatched), "all_to_all_single": len(native)})
    record_property("loss_rel_err_vs_cpu", [round(e, 9) for e in relative(losses, ref_losses)])
    assert losses == plain_losses
    assert not [name for name, g in grads.items() if not torch.equal(g, plain_grads[name])]
    assert max(relative(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert max(grad_errors(grads, ref_grads).values()) < 1e-4
    # per layer and micro-batch: forward 3 (counts, rows, combine), backward 2 (rows both ways)
    microbatches = cfg.train.global_batch_size // cfg.train.micro_batch_size
    assert len(dispatched) == 5 * cfg.model.num_layers * microbatches * 2, len(dispatched)
    assert len(native) == (len(dispatched) if lane.cuda else 0), len(native)
    assert all(work is not None for work in native), "the NCCL all-to-alls are started asynchronously"


@pytest.mark.parametrize("experts", ["gelu", "swiglu"])
def test_grouped_gemm_experts_match_padded_bmm_and_cpu(lane, record_property, experts):
    """``--moe-grouped-gemm --bf16``: on CUDA (SM80+) torch's ``grouped_mm`` runs the experts —
    the biased GELU experts through ``moe.grouped_mm.grouped_matmul``, the bias-free SwiGLU ones
    through ``moe.grouped_swiglu`` (its hand-written backward) — and must agree with the padded
    ``bmm`` experts on the same device and with the same grouped run on CPU."""
    kind = dict(swiglu=True, disable_bias_linear=True) if experts == "swiglu" else {}
    values = {**SHAPE, **MOE, **kind, "bf16": True}
    cfg = lane.config({**values, "moe_grouped_gemm": True})
    losses, grads, _ = train(cfg, lane.parallel(cfg), 2)
    ran = grouped_mm.grouped_mm_runs(
        lane.device, torch.bfloat16, cfg.model.hidden_size, cfg.model.expert_ffn_size, 2 if experts == "swiglu" else 1
    )
    record_property("grouped_mm_runs", ran)
    bmm_losses, bmm_grads, _ = train(lane.config(values), lane.parallel(cfg), 2)
    record_property("loss_rel_err_vs_bmm", [round(e, 8) for e in relative(losses, bmm_losses)])
    assert ran, "grouped_mm refused the experts here (the log says why); CUDA SM80+ with bf16 must run it"
    assert max(relative(losses, bmm_losses)) < 2e-3, (losses, bmm_losses)
    assert_16bit_close(record_property, {**values, "moe_grouped_gemm": True}, 2, losses, grads, bf16=True)


DEEPSEEK = dict(
    moe_router_score_function="sigmoid",
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_enable_expert_bias=True,
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
    disable_bias_linear=True,
    swiglu=True,
)


def test_expert_bias_updates_on_cuda_as_on_cpu(lane, record_property):
    """DeepSeek-style routing (sigmoid, group-limited top-k, shared experts) with the
    auxiliary-loss-free expert bias in fp32 on CUDA: 3 steps' losses against the CPU run, and
    the biases the checkpoint collects (a device-to-host copy) equal to the CPU run's."""
    from megatron_p2r.checkpoint.expert_bias import collect_expert_biases

    values = {**SHAPE, **MOE, **DEEPSEEK}
    cfg = lane.config(values)
    losses, _, state = train(cfg, lane.parallel(cfg), 3)
    biases = collect_expert_biases(state.model, state.ps)
    ref_losses, _, ref_state = cpu_run(values, 3, bf16=False)
    ref_biases = collect_expert_biases(ref_state.model, ref_state.ps)
    record_property("loss_rel_err", [round(e, 8) for e in relative(losses, ref_losses)])
    record_property("biases", biases)
    assert biases is not None and set(biases) == set(ref_biases)
    assert max(relative(losses, ref_losses)) < 1e-4, (losses, ref_losses)
    # a bias moves by sign steps of the update rate: equal unless a load tie broke differently
    assert all(max(abs(a - b) for a, b in zip(biases[k], ref_biases[k], strict=True)) < 1e-6 for k in biases), (
        biases,
        ref_biases,
    )
