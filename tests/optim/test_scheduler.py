"""The LR schedule and the fp16 loss scale follow Megatron-LM (OptimizerParamScheduler,
DynamicGradScaler at d98e8a64), in samples, with decoupled embedding/output LRs; the re-warm-up
after a delink or growth: the pure factor, its checkpointed state, and a bitwise resume in its middle."""

import math

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.config.batch import lr_lengths
from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.optim.scheduler import LRScheduler, check_rewarmup, learning_rate, rewarmup_factor, with_rewarmup
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state, train_step
from tests.checkpoint.common import metadata
from tests.helpers import random_microbatches, run_steps, tiny_config


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
        by_samples = tiny_config(
            **BASE, train_iters=None, train_samples=40, lr_warmup_samples=12, lr_decay_samples=32, lr_decay_style=style
        )
        assert lrs(by_iters, 10) == lrs(by_samples, 10)


def test_cosine_and_warmup_fraction():
    cfg = tiny_config(**BASE, train_iters=10, lr_warmup_fraction=0.25, lr_decay_style="cosine")  # warm-up 10 samples
    got = lrs(cfg, 11)
    assert got[1] == pytest.approx(0.4) and got[2] == pytest.approx(0.8)
    midpoint = 10 + (40 - 10) / 2  # samples
    assert lrs(cfg, int(midpoint) + 1, samples=1)[-1] == pytest.approx(0.55)
    assert got[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(got[3:], got[4:], strict=False))
    assert math.isclose(lrs(cfg, 11)[5], 0.1 + 0.45 * (1 + math.cos(math.pi * (20 - 10) / 30)))


def test_decoupled_lr_for_embedding_and_output():
    cfg = tiny_config(
        **BASE,
        train_iters=10,
        lr_decay_style="linear",
        decoupled_lr=0.5,
        decoupled_min_lr=0.05,
        untie_embeddings_and_output_weights=True,
    )
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
    monkeypatch.setattr("megatron_p2r.training.step.grad_norm_and_non_finite", lambda *a: (float("inf"), True))
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
    scaler = LossScaler(
        tiny_config(fp16=True, initial_loss_scale=1024.0, loss_scale_window=3, hysteresis=hysteresis).train
    )
    got = []
    for found_inf in pattern:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == megatron_scales(pattern, 1024.0, 3, hysteresis)
    restored = LossScaler(tiny_config(fp16=True, hysteresis=hysteresis).train)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


PSEUDO = dict(
    num_layers=4,
    p2r_phase="pseudo",
    share_pattern="all",
    train_iters=12,
    global_batch_size=4,
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    weight_decay=0.01,
    clip_grad=1.0,
    hidden_dropout=0.1,
    device="cpu",
    log_interval=100,
)


def scheduled(cfg, num_steps: int) -> float:
    """The LR without re-warm-up after ``num_steps`` samples."""
    warmup, decay = lr_lengths(cfg, 1)
    return learning_rate(num_steps, warmup, decay, cfg.train.lr_decay_style, cfg.train.lr, cfg.train.min_lr)


def test_rewarmup_factor_and_state():
    r = {"start": 5, "iters": 4}
    assert [rewarmup_factor(s, r) for s in range(4, 10)] == [1.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert rewarmup_factor(7, None) == 1.0
    assert with_rewarmup({"num_steps": 20, "updates": 5, "rewarmup": None}, 4) == {
        "num_steps": 20,
        "updates": 5,
        "rewarmup": r,
    }
    for bad in (
        {"start": 5},
        {"start": -1, "iters": 2},
        {"start": 1, "iters": 0},
        {"start": 1.5, "iters": 2},
        {"start": True, "iters": 2},
        [5, 4],
    ):
        with pytest.raises(ValueError, match="rewarmup must be null or"):
            check_rewarmup(bad)
    with pytest.raises(ValueError, match="--lr-rewarmup-iters must be >= 1"):
        with_rewarmup({"num_steps": 20, "updates": 5}, 0)
    cfg = tiny_config(**PSEUDO)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRScheduler(opt, cfg, 1)
    sched.load_state_dict({"num_steps": 20, "updates": 5, "rewarmup": r})
    assert sched.lr == scheduled(cfg, 20) * 0.25 and opt.param_groups[0]["lr"] == sched.lr
    sched.load_state_dict({"num_steps": 20})  # an imported checkpoint: no update count, no re-warm-up
    assert (sched.updates, sched.rewarmup, sched.lr) == (0, None, scheduled(cfg, 20))


def test_rewarmup_resumes_bitwise_across_a_save_in_its_middle(tmp_path):
    """Delink with --lr-rewarmup-iters 4 at step 2; train 4 steps straight, or 2 steps, save
    (in the middle of the re-warm-up), load and 2 more: the same losses and weights, bitwise,
    and the LR ramps as recorded. Dropout is on, so the resumed RNG streams count too."""
    _, pseudo = run_steps(tiny_config(**PSEUDO), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "pseudo"), pseudo)
    convert(
        str(tmp_path / "pseudo"), str(tmp_path / "real"), Target(), DelinkOptions(lr_rewarmup_iters=4), progress=False
    )
    assert metadata(str(tmp_path / "real" / "iter_0000002"))["scheduler"]["rewarmup"] == {"start": 2, "iters": 4}
    cfg = tiny_config(**{**PSEUDO, "p2r_phase": "real"})
    lrs = []
    seed_everything(cfg.train.seed, 0, 0, torch.device("cpu"))  # the converted checkpoint has no RNG: a fresh run's
    straight, full = run_steps(
        cfg,
        ParallelState.single(),
        4,
        load=str(tmp_path / "real"),
        after_step=lambda s: lrs.append(s.optimizer.param_groups[0]["lr"]),
    )
    assert lrs == [scheduled(cfg, 4 * s) * f for s, f in zip(range(3, 7), (0.5, 0.75, 1.0, 1.0), strict=True)]
    seed_everything(cfg.train.seed, 0, 0, torch.device("cpu"))
    first, half = run_steps(cfg, ParallelState.single(), 2, load=str(tmp_path / "real"))
    save_checkpoint(str(tmp_path / "half"), half)
    assert metadata(str(tmp_path / "half" / "iter_0000004"))["scheduler"]["rewarmup"] == {"start": 2, "iters": 4}
    second, resumed = run_steps(cfg, ParallelState.single(), 2, load=str(tmp_path / "half"))
    assert first + second == straight
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.scheduler.state_dict() == full.scheduler.state_dict()
