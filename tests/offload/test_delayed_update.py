"""--cpu-offload-delayed-param-update (optim/delayed_update.py) against an oracle written here:
the serial host step (no overlap, no delay) with the offloaded layers' weights put back, after
each iteration, to what a one-step delayed update has written by then — iteration t's update
(its gradients, clipping, skip decision and learning rate) in the weights from iteration t+2 on,
the resident layers' at once. Bitwise: the same optimizer pieces run on the same values.

Clipping is on (every norm above CLIP) and the learning rate changes every step; fp16 with a
loss scale that overflows skips steps. A slowed host step makes each delayed step run through
the whole next iteration: no weight may change mid-iteration.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.config import ConfigError, num_microbatches, validate
from megatron_p2r.optim.delayed_update import DelayedHostStep
from megatron_p2r.optim.host_step import HostStep
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.memory import offload_plan
from tests.harness import run_distributed
from megatron_p2r.training import build_datasets, build_train_state, microbatch_iterator, setup_parallel, train_step
from tests.helpers import run_steps, tiny_config

CLIP = 0.5
BASE = dict(
    num_layers=4,
    global_batch_size=4,
    clip_grad=CLIP,
    cpu_offload_layers="0,2",
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    weight_decay=0.1,
    bf16=True,
)
DPU = dict(
    overlap_cpu_optimizer_d2h_h2d=True,
    cpu_offload_delayed_param_update=True,
    cpu_offload_delayed_param_update_warmup_steps=0,
)
FP16_SKIPS = dict(bf16=False, fp16=True, initial_loss_scale=2.0**19, hysteresis=1, loss_scale_window=1)


def _result(state, losses, outs) -> dict:
    weights = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    moments = {
        n: {k: v.clone() for k, v in state.optimizer.state[p].items()}
        for n, p in state.model.named_parameters()
        if p in state.optimizer.state
    }
    return {"losses": losses, "norms": [o["grad_norm"] for o in outs], "weights": weights, "moments": moments}


def _dpu(ps: ParallelState, steps: int, **kw) -> dict:
    cfg = tiny_config(**{**BASE, **DPU, **kw})
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    outs: list = []
    losses, state = run_steps(cfg, ps, steps, outputs=outs)
    assert isinstance(state.optimizer.inner["host"], DelayedHostStep)
    state.optimizer.finish_host_step()
    return _result(state, losses, outs)


def _oracle(ps: ParallelState, steps: int, **kw) -> dict:
    """The serial run, its offloaded weights set after each iteration to those of the delayed run."""
    kw = {**BASE, **kw}
    warmup = kw.pop("cpu_offload_delayed_param_update_warmup_steps", 0)
    kw.pop("host_optimizer_threads", None)
    cfg = tiny_config(**kw)
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    state = build_train_state(cfg, ps)
    data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
    offloaded = [p for p in state.model.parameters() if id(p) in state.offload.offloaded_param_ids]

    def snapshot():
        return [p.detach().clone() for p in offloaded]

    def restore(values):
        with torch.no_grad():
            for p, v in zip(offloaded, values, strict=True):
                p.copy_(v)

    current, pending, taken, losses, outs = snapshot(), None, 0, [], []
    for _ in range(steps):
        out = train_step(state, [next(data) for _ in range(num_microbatches(cfg, ps.layout.world_size))])
        losses.append(out["lm_loss"])
        outs.append(out)
        stepped = not out["skipped"]
        written, pending = pending, None  # written once this iteration's backward is over
        if stepped and taken >= warmup:  # a delayed step: its weights wait for the next iteration
            pending = snapshot()
            restore(written or current)
        elif not stepped:
            restore(written or current)
        current, taken = snapshot(), taken + stepped
    if pending is not None:  # the end of training writes it
        restore(pending)
    return _result(state, losses, outs)


def _bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and str(a["norms"]) == str(b["norms"])
    assert min(n for n in a["norms"] if math.isfinite(n)) > CLIP
    assert a["moments"].keys() == b["moments"].keys()
    for n, w in a["weights"].items():
        assert torch.equal(w, b["weights"][n]), n
        for k, m in a["moments"][n].items():
            assert torch.equal(m, b["moments"][n][k]), (n, k)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(cpu_offload_delayed_param_update_warmup_steps=2),
        dict(host_optimizer_threads=2),
        FP16_SKIPS,
        dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16", optimizer="adafactor"),
        dict(optimizer="lion"),
    ],
    ids=["bf16", "warmup-2", "2-threads", "fp16-skips", "adafactor-bf16-grads", "lion"],
)
def test_delayed_update_is_the_serial_step_applied_one_iteration_late(kw):
    ps = ParallelState.single()
    steps = 7 if kw.get("fp16") else 5
    dpu, oracle = _dpu(ps, steps, **kw), _oracle(ps, steps, **kw)
    if kw.get("fp16"):  # a skipped iteration right after a taken one, and taken ones after it
        skipped = [not math.isfinite(n) for n in oracle["norms"]]
        assert any(skipped[i] and not skipped[i - 1] for i in range(1, steps - 1)), oracle["norms"]
    _bitwise(dpu, oracle)


def test_the_delay_changes_training():
    """The oracle is not the undelayed run: the losses part from the third iteration on."""
    ps = ParallelState.single()
    oracle = _oracle(ps, 4)
    cfg = tiny_config(**BASE)
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    serial, _ = run_steps(cfg, ps, 4)
    assert oracle["losses"][:2] == serial[:2] and oracle["losses"][2:] != serial[2:]


def test_slow_host_step_changes_no_weight_mid_iteration():
    """Each layer's step takes 0.3 s, longer than an iteration here: the next iteration runs while
    it writes the mains, and its fetches, recomputations and backward must all read the old weights."""
    real = HostStep._step_layer

    def slowed(self, key, coeff, **kw):
        time.sleep(0.3)
        real(self, key, coeff, **kw)

    HostStep._step_layer = slowed
    try:
        ps = ParallelState.single()
        dpu = _dpu(ps, 4, global_batch_size=8)
    finally:
        HostStep._step_layer = real
    _bitwise(dpu, _oracle(ps, 4, global_batch_size=8))


def _dp2(rank, world):
    ps, _ = setup_parallel(tiny_config(**BASE), torch.device("cpu"))
    losses = []
    for kw in ({}, dict(overlap_grad_reduce=True)):
        dpu = _dpu(ps, 4, **kw)
        _bitwise(dpu, _oracle(ps, 4, **kw))
        losses.append(dpu["losses"])
    return losses


def test_dp2_delayed_update_is_the_serial_step_applied_one_iteration_late():
    """Buckets reduced after backward, and with --overlap-grad-reduce during it (then swapped)."""
    losses = run_distributed(_dp2, 2)
    assert losses[0] == losses[1]


def _pp2(rank, world):
    kw = dict(pipeline_model_parallel_size=2, global_batch_size=8)
    ps, _ = setup_parallel(tiny_config(**{**BASE, **kw}), torch.device("cpu"))
    _bitwise(_dpu(ps, 4, **kw), _oracle(ps, 4, **kw))
    return rank


def test_pp2_delayed_update_is_the_serial_step_applied_one_iteration_late():
    """1F1B over 8 micro-batches, one offloaded layer per stage."""
    assert run_distributed(_pp2, 2) == [0, 1]


def test_resume_is_bitwise(tmp_path):
    """2 steps, save (which writes the pending update into the weights), 2 more; or load that
    checkpoint into a fresh run and take the 2 more."""
    cfg = tiny_config(**BASE, **DPU)
    ps = ParallelState.single()
    saved: list = []

    def save_after_two(state):
        if state.iteration == 2:
            saved.append(save_checkpoint(str(tmp_path), state))

    seed_everything(cfg.train.seed, 0, 0, ps.device)
    straight, full = run_steps(cfg, ps, 4, after_step=save_after_two)
    second, resumed = run_steps(cfg, ps, 2, load=str(tmp_path))
    assert saved and second == straight[2:]
    full.optimizer.finish_host_step()
    resumed.optimizer.finish_host_step()
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    "kw", [{}, dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16")], ids=["fp32-grads", "bf16-grads"]
)
def test_planner_counts_the_second_gradient_buffer(kw):
    """The bytes of the second gradient tensors a rank allocates are the planner's grads_delayed,
    and the runtime's report says the same."""
    cfg = tiny_config(**BASE, **DPU, **kw)
    ps = ParallelState.single()
    state = build_train_state(cfg, ps)
    second = [b.second_grad for buf in state.ddp.buffers for b in buf.buckets if b.second_grad is not None]
    allocated = sum(t.untyped_storage().nbytes() for t in second)
    planned = offload_plan(cfg, state.plan, 0)["host"]["grads_delayed"]
    assert allocated == planned == state.offload.describe()["host"]["grads_delayed"] > 0
    assert planned == offload_plan(cfg, state.plan, 0)["host"]["grads"]
    assert "grads_delayed" not in offload_plan(tiny_config(**BASE), state.plan, 0)["host"]


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(overlap_cpu_optimizer_d2h_h2d=False), "needs --overlap-cpu-optimizer-d2h-h2d"),
        (dict(bf16=False), "needs 16-bit weights"),
        (
            dict(bf16=False, fp16=True, main_params_dtype="fp16", use_precision_aware_optimizer=True),
            "fp16 weights are then their own main parameters",
        ),
        (dict(cpu_offload_optimizer_nvme_path="/tmp/x"), "not supported with --cpu-offload-optimizer-nvme-path"),
        (dict(use_distributed_optimizer=True), "not supported with --use-distributed-optimizer"),
    ],
)
def test_flag_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**{**BASE, **DPU, **kw}), 1)
