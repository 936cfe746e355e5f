"""Training steps on CUDA against the CPU fp32 reference (same weights, same data), and the
MoE layer through NCCL's all_to_all_single.

Tolerances (relative L2 error of each gradient tensor, relative error of each loss):
- fp32 on CUDA: 1e-4 / 1e-5 — different kernels and reduction orders, same precision;
- bf16 on CUDA: gradients 3e-2, losses 2e-3 — bf16 operands with fp32 accumulation give
  1e-3..1e-2; bf16 autocast on CPU gives 7.6e-3 (worst: a norm weight) / 1e-5 for this shape.
"""
from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from tests.helpers import run_steps, tiny_config  # noqa: E402

pytestmark = pytest.mark.cuda

# Small enough for the CPU reference and the dry run; head_dim 32 takes the fused SDPA kernels.
SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=1000,
             micro_batch_size=4, global_batch_size=8, clip_grad=1.0, weight_decay=0.01, lr=1e-3)
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def cpu_reference(values: dict, steps: int):
    """Losses and final state of the same run in fp32 on CPU (one process, no groups)."""
    cfg = tiny_config(**{**values, "bf16": False, "device": "cpu"})
    return run_steps(cfg, ParallelState.single(), steps)


def grad_errors(state, ref_state) -> dict:
    """{name: ||grad - reference|| / ||reference||} over every parameter."""
    ref = dict(ref_state.model.named_parameters())
    out = {}
    for name, p in state.model.named_parameters():
        want = ref[name].grad.double()
        got = p.main_grad   # the reduced fp32 gradient (16-bit weights have no .grad after the step)
        out[name] = ((got.detach().cpu().double() - want).norm() / want.norm().clamp(min=1e-30)).item()
    return out


def relative(a: list, b: list) -> list:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_training_step_matches_cpu_fp32_reference(lane, record_property, bf16):
    values = {**SHAPE, "bf16": bf16}
    cfg = lane.config(values)
    _, first = run_steps(cfg, lane.parallel(cfg), 1)
    losses, state = run_steps(cfg, lane.parallel(cfg), 3)
    _, ref_first = cpu_reference(values, 1)
    ref_losses, _ = cpu_reference(values, 3)
    grad_err = grad_errors(first, ref_first)
    loss_err = relative(losses, ref_losses)
    worst = max(grad_err, key=grad_err.get)
    record_property("loss_rel_err", [round(e, 8) for e in loss_err])
    record_property("grad_rel_err_max", round(grad_err[worst], 8))
    record_property("grad_rel_err_worst_tensor", worst)
    if lane.cuda:  # the device optimizer is torch's fused AdamW (optim.optimizer.adamw's first choice)
        assert state.optimizer.inner["device"].defaults.get("fused"), state.optimizer.inner["device"].defaults
    grad_tol, loss_tol = (3e-2, 2e-3) if bf16 else (1e-4, 1e-5)
    assert grad_err[worst] < grad_tol, (worst, grad_err)
    assert max(loss_err) < loss_tol, (losses, ref_losses)


def test_moe_forward_backward_through_nccl_all_to_all(lane, record_property, monkeypatch):
    """EP=1 has no ep group, so the dispatcher would skip communication; giving the model a
    one-rank ep group makes it run the real path — the count exchange and the row all-to-all,
    forward and backward — through ``dist.all_to_all_single`` on NCCL. A one-rank all-to-all is
    a copy, so losses and gradients must equal the group-less run bitwise, and the CPU fp32
    reference within fp32 tolerance."""
    values = {**SHAPE, **MOE}
    cfg = lane.config(values)
    calls = []
    native = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return native(*args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", counting)
    plain_losses, plain = run_steps(cfg, lane.parallel(cfg), 2)
    assert not calls, "the group-less run (EP=1) must not communicate"
    ep_group = dist.new_group([0])
    ps = lane.parallel(cfg)
    with_group = ParallelState(layout=ps.layout, rank=ps.rank, device=ps.device, groups={**ps.groups, "ep": ep_group})
    losses, state = run_steps(cfg, with_group, 2)
    ref_losses, ref_state = cpu_reference(values, 2)
    record_property("backend", dist.get_backend(ep_group))
    record_property("all_to_all_single_calls", len(calls))
    record_property("loss_rel_err_vs_cpu", [round(e, 9) for e in relative(losses, ref_losses)])
    assert losses == plain_losses
    for (name, p), q in zip(state.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert max(relative(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert max(grad_errors(state, ref_state).values()) < 1e-4
    lane.needs_cuda("the NCCL all_to_all_single path (gloo builds it from send/recv)")
    assert dist.get_backend(ep_group) == "nccl"
    # per layer and micro-batch: forward 3 (counts, rows, combine), backward 2 (rows both ways)
    microbatches = cfg.train.global_batch_size // cfg.train.micro_batch_size
    assert len(calls) == 5 * cfg.model.num_layers * microbatches * 2, len(calls)
