"""The LR schedule and the fp16 loss scale follow Megatron-LM (OptimizerParamScheduler,
DynamicGradScaler at d98e8a64), in samples, with decoupled embedding/output LRs."""
import math

import pytest
import torch

from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.optim.scheduler import LRScheduler
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state, train_step
from tests.helpers import random_microbatches, tiny_config


def lrs(cfg, steps: int, samples: int = 4) -> list:
    """The LR before each of ``steps`` applied updates of ``samples`` samples."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = LRScheduler(optimizer, cfg, 1)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(samples)
    return out


BASE = dict(lr=1.0, min_lr=0.1, global_batch_size=4, micro_batch_size=4)


def test_warmup_from_zero_then_linear_decay():
    """Megatron: lr = max * samples / warm-up up to the warm-up's end (0 at the first step), then a
    linear decay reaching min_lr at the decay's end, min_lr after it."""
    got = lrs(tiny_config(**BASE, train_iters=10, lr_warmup_iters=2, lr_decay_style="linear"), 12)
    want = [0.0, 0.5, 1.0] + [1.0 - 0.9 * k / 8 for k in range(1, 8)] + [0.1, 0.1]
    assert got == pytest.approx(want)


def test_sample_flags_give_the_iteration_schedule():
    """With a constant batch, --train-samples/--lr-*-samples in samples = the iteration flags x batch."""
    for style in ("linear", "cosine", "constant"):
        by_iters = tiny_config(**BASE, train_iters=10, lr_warmup_iters=3, lr_decay_iters=8, lr_decay_style=style)
        by_samples = tiny_config(**BASE, train_iters=None, train_samples=40, lr_warmup_samples=12,
                                 lr_decay_samples=32, lr_decay_style=style)
        assert lrs(by_iters, 10) == lrs(by_samples, 10)


def test_cosine_and_warmup_fraction():
    cfg = tiny_config(**BASE, train_iters=10, lr_warmup_fraction=0.25, lr_decay_style="cosine")  # warm-up 10 samples
    got = lrs(cfg, 11)
    assert got[1] == pytest.approx(0.4) and got[2] == pytest.approx(0.8)
    midpoint = 10 + (40 - 10) / 2  # samples
    assert lrs(cfg, int(midpoint) + 1, samples=1)[-1] == pytest.approx(0.55)
    assert got[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(got[3:], got[4:]))
    assert math.isclose(lrs(cfg, 11)[5], 0.1 + 0.45 * (1 + math.cos(math.pi * (20 - 10) / 30)))


def test_decoupled_lr_for_embedding_and_output():
    cfg = tiny_config(**BASE, train_iters=10, lr_decay_style="linear", decoupled_lr=0.5, decoupled_min_lr=0.05,
                      untie_embeddings_and_output_weights=True)
    state = build_train_state(cfg, ParallelState.single())
    names = {id(p): n for n, p in state.model.named_parameters()}
    for _ in range(5):
        state.scheduler.step(4)
    by_name = {names[id(p)]: g["lr"] for g in state.optimizer.param_groups for p in g["params"]}
    decoupled = {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert {n for n, lr in by_name.items() if lr == pytest.approx(0.5 - 0.45 * 20 / 40)} == decoupled
    assert all(lr == pytest.approx(1.0 - 0.9 * 20 / 40) for n, lr in by_name.items() if n not in decoupled)


def test_skipped_step_does_not_advance_the_schedule(monkeypatch):
    """Megatron advances the LR schedule only after an applied update; samples are consumed anyway."""
    cfg = tiny_config(**BASE, train_iters=10, lr_warmup_iters=2)
    state = build_train_state(cfg, ParallelState.single())
    batches = random_microbatches(cfg, 1, 4)
    train_step(state, batches)
    monkeypatch.setattr("megatron_p2r.training.grad_norm_and_non_finite", lambda *a: (float("inf"), True))
    assert train_step(state, batches)["skipped"]
    assert (state.scheduler.num_steps, state.consumed_samples, state.iteration) == (4, 8, 2)


def megatron_scales(found_infs, initial, window, hysteresis, min_scale=1.0):
    """DynamicGradScaler.update (growth 2, backoff 0.5), the scale after each step."""
    scale, growth, left, out = initial, 0, hysteresis, []
    for found_inf in found_infs:
        if found_inf:
            growth, left = 0, left - 1
            if left <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, left, scale = 0, hysteresis, scale * 2.0
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_loss_scale_hysteresis(hysteresis):
    pattern = [True, False, True, True, False, False, False, True, True, True, False, False, True]
    scaler = LossScaler(tiny_config(fp16=True, initial_loss_scale=1024.0, loss_scale_window=3,
                                    hysteresis=hysteresis).train)
    got = []
    for found_inf in pattern:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == megatron_scales(pattern, 1024.0, 3, hysteresis)
    restored = LossScaler(tiny_config(fp16=True, hysteresis=hysteresis).train)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
