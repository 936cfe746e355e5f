"""The overlapped host step (``--overlap-cpu-optimizer-d2h-h2d``) gives bitwise the weights,
optimizer state and losses of the serial host step: fp32 and bf16, AdamW, Lion and Adafactor, clipping on (every step's norm
is above CLIP, so the clip coefficient matters), one process and DP=2.

A slowed host step forces the next forward to reach an offloaded layer while its step still
runs: that layer's fetch must wait for it.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.optim.host_step import HostStep
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import run_steps, tiny_config

CLIP = 0.5  # below every step's gradient norm
# The learning rate changes every step (warm-up, then cosine) and weight decay is on: the worker
# must step with the rate of its step, not the one the scheduler sets while it runs.
BASE = dict(
    num_layers=4,
    global_batch_size=4,
    clip_grad=CLIP,
    cpu_offload_layers="0,2",
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    weight_decay=0.1,
)


def _train(ps: ParallelState, overlap: bool, steps: int = 3, slow: float = 0.0, **kw):
    cfg = tiny_config(**{**BASE, **kw}, overlap_cpu_optimizer_d2h_h2d=overlap)
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    outs: list = []
    if slow:
        real = HostStep._step_layer

        def slowed(self, shards, coeff):
            time.sleep(slow)
            real(self, shards, coeff)

        HostStep._step_layer = slowed
    try:
        losses, state = run_steps(cfg, ps, steps, outputs=outs)
    finally:
        if slow:
            HostStep._step_layer = real
    state.optimizer.finish_host_step()
    weights = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    moments = {
        n: {k: v.clone() for k, v in state.optimizer.state[p].items()}  # AdamW's, Lion's or Adafactor's
        for n, p in state.model.named_parameters()
        if p in state.optimizer.state
    }  # none before a step
    return {
        "losses": losses,
        "norms": [o["grad_norm"] for o in outs],
        "weights": weights,
        "moments": moments,
        "overlapped": isinstance(state.optimizer.inner.get("host"), HostStep),
    }


def _bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and str(a["norms"]) == str(b["norms"])  # nan: a skipped step
    assert min(n for n in a["norms"] if math.isfinite(n)) > CLIP
    assert a["moments"].keys() == b["moments"].keys()
    for n, w in a["weights"].items():
        assert torch.equal(w, b["weights"][n]), n
        for k, m in a["moments"].get(n, {}).items():
            assert torch.equal(m, b["moments"][n][k]), (n, k)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(bf16=True),
        dict(fp16=True, initial_loss_scale=2.0**19, hysteresis=1, loss_scale_window=1),
        dict(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
        dict(bf16=True, optimizer="lion"),
        dict(optimizer="adafactor"),
    ],
    ids=["fp32", "bf16", "fp16-skips", "bf16-moments", "lion-bf16", "adafactor"],
)
def test_overlapped_host_step_is_bitwise_the_serial_one(kw):
    """fp16: the scale overflows, halves, grows back after each finite step and overflows again,
    so steps are skipped (no host step submitted) after taken ones: the DDP must zero the host
    gradients of a skipped step itself."""
    ps = ParallelState.single()
    steps = 7 if kw.get("fp16") else 3
    serial, overlapped = _train(ps, False, steps=steps, **kw), _train(ps, True, steps=steps, **kw)
    assert overlapped["overlapped"] and not serial["overlapped"]
    if kw.get("fp16"):
        skipped = [not math.isfinite(n) for n in serial["norms"]]
        assert any(skipped[i] and not skipped[i - 1] for i in range(1, steps - 1)), serial["norms"]
    _bitwise(serial, overlapped)


def test_next_forward_waits_for_each_layers_step():
    """Each layer's step takes 0.2 s: the next forward reaches layer 0 and 2 before their steps end."""
    ps = ParallelState.single()
    _bitwise(_train(ps, False), _train(ps, True, slow=0.2))


def _dp2(rank, world):
    ps, _ = setup_parallel(tiny_config(**BASE), torch.device("cpu"))
    serial, overlapped = _train(ps, False), _train(ps, True)
    _bitwise(serial, overlapped)
    return overlapped["losses"]


def test_dp2_overlapped_host_step_is_bitwise_the_serial_one():
    losses = run_distributed(_dp2, 2)
    assert losses[0] == losses[1]


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(cpu_offload_layers="0,2", cpu_offload_what="optimizer"), "needs --cpu-offload-layers"),
        (dict(cpu_offload_layers=None), "needs --cpu-offload-layers"),
        (
            dict(cpu_offload_layers="0,2", use_distributed_optimizer=True),
            "not supported with --use-distributed-optimizer",
        ),
    ],
)
def test_flag_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**{**BASE, **kw}, overlap_cpu_optimizer_d2h_h2d=True), 1)
