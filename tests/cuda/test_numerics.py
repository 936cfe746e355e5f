"""Training steps on CUDA against the CPU fp32 reference (same weights, same data), and the
MoE layer through NCCL's all_to_all_single.

Tolerances (relative L2 error of each first-step gradient tensor, relative error of each loss):
- fp32 on CUDA: 1e-4 / 1e-5 — different kernels and reduction orders, same precision;
- bf16 on CUDA (bf16 weights and activations, fp32 main gradients, as ``--bf16`` trains):
  each gradient no further from the fp32 reference than 3x what the same bf16 run on CPU gives
  (at least 1e-2), losses 2e-3. bf16 itself sets the scale: on CPU at this shape the matmul
  weights' gradients are off by about 7e-3, the norm parameters' by 2e-2..7e-2 (their
  gradients are sums over every token of bf16 values), the losses by 2e-5.
"""
from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_p2r.parallel import mappings  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from tests.helpers import run_steps, tiny_config  # noqa: E402

pytestmark = pytest.mark.cuda

# Small enough for the CPU reference and the dry run; head_dim 32 takes the fused SDPA kernels.
SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=1000,
             micro_batch_size=4, global_batch_size=8, clip_grad=1.0, weight_decay=0.01, lr=1e-3)
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def train(cfg, ps, steps: int):
    """(losses, {name: the fp32 gradient of the first step}, final state)."""
    first = {}

    def keep_first(state):
        if not first:  # the reduced fp32 gradient: 16-bit weights have no .grad after the step
            first.update({name: p.main_grad.detach().to("cpu", torch.float64, copy=True)
                          for name, p in state.model.named_parameters()})

    losses, state = run_steps(cfg, ps, steps, after_step=keep_first)
    return losses, first, state


def cpu_run(values: dict, steps: int, bf16: bool = False):
    """The same run on CPU (one process, no groups): fp32 is the reference."""
    return train(tiny_config(**{**values, "bf16": bf16, "device": "cpu"}), ParallelState.single(), steps)


def grad_errors(grads: dict, reference: dict) -> dict:
    """{name: ||grad - reference|| / ||reference||} over every parameter."""
    return {name: ((g - reference[name]).norm() / reference[name].norm().clamp(min=1e-30)).item()
            for name, g in grads.items()}


def relative(a: list, b: list) -> list:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def worst(errors: dict) -> tuple:
    name = max(errors, key=errors.get)
    return name, round(errors[name], 8)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_training_step_matches_cpu_fp32_reference(lane, record_property, bf16):
    values = {**SHAPE, "bf16": bf16}
    cfg = lane.config(values)
    losses, grads, state = train(cfg, lane.parallel(cfg), 3)
    ref_losses, ref_grads, _ = cpu_run(values, 3)
    grad_err, loss_err = grad_errors(grads, ref_grads), relative(losses, ref_losses)
    record_property("loss_rel_err", [round(e, 8) for e in loss_err])
    record_property("grad_rel_err_worst", worst(grad_err))
    # the device optimizer is torch's fused AdamW (optim.optimizer.adamw's first choice)
    assert state.optimizer.inner["device"].defaults.get("fused"), state.optimizer.inner["device"].defaults
    if bf16:
        _, cpu_bf16_grads, _ = cpu_run(values, 1, bf16=True)
        cpu_err = grad_errors(cpu_bf16_grads, ref_grads)
        record_property("cpu_bf16_grad_rel_err_worst", worst(cpu_err))
        over = {n: (e, cpu_err[n]) for n, e in grad_err.items() if e >= max(3 * cpu_err[n], 1e-2)}
        assert not over, f"gradients further from fp32 than 3x bf16 on CPU: {over}"
        assert max(loss_err) < 2e-3, (losses, ref_losses)
    else:
        assert max(grad_err.values()) < 1e-4, grad_err
        assert max(loss_err) < 1e-5, (losses, ref_losses)


def test_moe_forward_backward_through_nccl_all_to_all(lane, record_property, monkeypatch):
    """EP=1 has no ep group, so the dispatcher would skip communication; giving the model a
    one-rank ep group makes it run the real path — the count exchange and the row all-to-all,
    forward and backward — through ``dist.all_to_all_single`` on NCCL (gloo has none: there the
    dispatcher's all-to-alls are send/recv, none of them to another rank). A one-rank all-to-all
    is a copy, so losses and gradients must equal the group-less run bitwise, and the CPU fp32
    reference within fp32 tolerance."""
    values = {**SHAPE, **MOE}
    cfg = lane.config(values)
    dispatched, native = count_calls(monkeypatch, mappings, "_all_to_all_single"), count_calls(
        monkeypatch, dist, "all_to_all_single")
    plain_losses, plain_grads, _ = train(cfg, lane.parallel(cfg), 2)
    assert not dispatched, "the group-less run (EP=1) must not communicate"
    ps = lane.parallel(cfg)
    with_group = ParallelState(layout=ps.layout, rank=ps.rank, device=ps.device,
                               groups={**ps.groups, "ep": dist.new_group([0])})
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


def count_calls(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` by a wrapper that records each call; the list of calls."""
    calls, function = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls
