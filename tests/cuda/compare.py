"""How a lane test compares a run on the lane's device with the same run on CPU: losses,
first-step gradients (the reduced fp32 ``main_grad``), and the tolerances of each precision.

Tolerances (relative L2 error of each first-step gradient tensor, relative error of each loss):
- fp32 on CUDA against fp32 on CPU: 1e-4 / 1e-5 — different kernels and reduction orders, same
  precision;
- 16-bit on CUDA (bf16 or fp16 weights and activations, fp32 main gradients): each gradient no
  further from the CPU fp32 reference than 3x what the same 16-bit run on CPU gives (at least
  1e-2), losses 2e-3. The 16-bit format itself sets the scale: on CPU at the lane's shapes the
  matmul weights' gradients are off by about 7e-3, the norm parameters' by 2e-2..7e-2 (their
  gradients are sums over every token of bf16 values), the losses by 2e-5.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_p2r.parallel.state import ParallelState
from tests.helpers import run_steps, tiny_config

LOSS_FP32, GRAD_FP32 = 1e-5, 1e-4
LOSS_16BIT, GRAD_16BIT_FLOOR, GRAD_16BIT_FACTOR = 2e-3, 1e-2, 3.0


def train(cfg, ps, steps: int, outputs: list = None) -> Tuple[List[float], Dict[str, torch.Tensor], object]:
    """(losses, {name: the fp32 gradient of the first step, on CPU in float64}, final state)."""
    first: Dict[str, torch.Tensor] = {}

    def keep_first(state):
        if not first:  # the reduced fp32 gradient: 16-bit weights have no .grad after the step
            first.update(
                {
                    name: p.main_grad.detach().to("cpu", torch.float64, copy=True)
                    for name, p in state.model.named_parameters()
                }
            )

    losses, state = run_steps(cfg, ps, steps, after_step=keep_first, outputs=outputs)
    return losses, first, state


def cpu_run(values: dict, steps: int, outputs: list = None, **precision):
    """The same run on CPU (one process, no groups); ``precision`` overrides (bf16=False: the
    fp32 reference)."""
    return train(tiny_config(**{**values, **precision, "device": "cpu"}), ParallelState.single(), steps, outputs)


def grad_errors(grads: dict, reference: dict) -> dict:
    """{name: ||grad - reference|| / ||reference||} over every parameter."""
    return {
        name: ((g - reference[name]).norm() / reference[name].norm().clamp(min=1e-30)).item()
        for name, g in grads.items()
    }


def relative(a: list, b: list) -> list:
    return [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True)]


def worst(errors: dict) -> tuple:
    name = max(errors, key=errors.get)
    return name, round(errors[name], 8)


def assert_fp32_close(record_property, losses, grads, ref_losses, ref_grads) -> None:
    grad_err, loss_err = grad_errors(grads, ref_grads), relative(losses, ref_losses)
    record_property("loss_rel_err", [round(e, 8) for e in loss_err])
    record_property("grad_rel_err_worst", worst(grad_err))
    assert max(grad_err.values()) < GRAD_FP32, grad_err
    assert max(loss_err) < LOSS_FP32, (losses, ref_losses)


def assert_16bit_close(record_property, values: dict, steps: int, losses, grads, **precision) -> None:
    """A 16-bit run on the device (``losses``, ``grads``: the parameters to compare) against the
    same 16-bit run on CPU (losses) and the CPU fp32 reference (gradients, scaled by what 16 bits
    cost on CPU)."""
    cpu_losses, cpu_grads, _ = cpu_run(values, steps, **precision)
    # the first step's gradients, which no host-step variant changes (the delayed update needs
    # 16-bit weights: the step plan refuses it in fp32)
    fp32 = {k: v for k, v in values.items() if k != "cpu_offload_delayed_param_update"}
    _, ref_grads, _ = cpu_run(fp32, 1, bf16=False, fp16=False)
    loss_err = relative(losses, cpu_losses)
    grad_err, cpu_err = grad_errors(grads, ref_grads), grad_errors({n: cpu_grads[n] for n in grads}, ref_grads)
    record_property("loss_rel_err_vs_cpu_16bit", [round(e, 8) for e in loss_err])
    record_property("grad_rel_err_vs_fp32_worst", {"device": worst(grad_err), "cpu": worst(cpu_err)})
    over = {
        n: (e, cpu_err[n]) for n, e in grad_err.items() if e >= max(GRAD_16BIT_FACTOR * cpu_err[n], GRAD_16BIT_FLOOR)
    }
    assert not over, f"gradients further from fp32 than {GRAD_16BIT_FACTOR}x 16 bits on CPU: {over}"
    assert max(loss_err) < LOSS_16BIT, (losses, cpu_losses)


def count_calls(monkeypatch, owner, name: str, keep=lambda args, result: args) -> list:
    """Replace ``owner.name`` by a wrapper that records ``keep(args, result)`` of each call."""
    calls, function = [], getattr(owner, name)

    def counting(*args, **kwargs):
        result = function(*args, **kwargs)
        calls.append(keep(args, result))
        return result

    monkeypatch.setattr(owner, name, counting)
    return calls
