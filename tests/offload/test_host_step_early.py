"""The host step that starts in backward (``--overlap-cpu-optimizer-d2h-h2d`` with ``--clip-grad 0``
and no fp16): each offloaded layer's step starts as soon as its gradients are final (after its
DP reduction), on one or two worker threads, and gives bitwise the weights, optimizer state,
losses and gradient norms of the serial step — AdamW, Lion and Adafactor, fp32 and bf16, one
process, DP=2 with and without --overlap-grad-reduce, PP=2 — and resumes bitwise.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_p2r.optim.host_step import HostStep
from megatron_p2r.parallel import ddp as ddp_module
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import run_steps, tiny_config

# The learning rate changes every step and weight decay is on: a step must use its own rate.
BASE = dict(
    num_layers=4,
    global_batch_size=4,
    clip_grad=0.0,
    cpu_offload_layers="0,2",
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    weight_decay=0.1,
)


def _train(ps: ParallelState, overlap: bool, steps: int = 3, slow: float = 0.0, pause: float = 0.05, **kw) -> dict:
    """``started``: per step, how many offloaded layers' steps had started when backward ended.
    ``pause``: the main thread waits that long after backward, so the early steps are done before
    the gradient norm reads the gradients they stepped on; ``slow``: each layer's step takes that
    much longer."""
    serial = {} if overlap else dict(host_optimizer_threads=1)  # threads are the overlapped step's (refused without)
    cfg = tiny_config(**{**BASE, **kw, **serial}, overlap_cpu_optimizer_d2h_h2d=overlap)
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    started, outs = [], []
    real_finish, real_step = ddp_module.DistributedDataParallel.finish_grad_sync, HostStep._step_layer

    def finish(ddp):
        if ddp.reduction_started is not None:
            started.append(len(ddp.reduction_started.__self__.stepper._running))
            time.sleep(pause)
        real_finish(ddp)

    def slowed(self, *args, **kwargs):
        time.sleep(slow)
        real_step(self, *args, **kwargs)

    ddp_module.DistributedDataParallel.finish_grad_sync = finish
    HostStep._step_layer = slowed
    try:
        losses, state = run_steps(cfg, ps, steps, outputs=outs)
    finally:
        ddp_module.DistributedDataParallel.finish_grad_sync, HostStep._step_layer = real_finish, real_step
    state.optimizer.finish_host_step()
    weights = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    moments = {
        n: {k: v.clone() for k, v in state.optimizer.state[p].items()}
        for n, p in state.model.named_parameters()
        if p in state.optimizer.state
    }
    return {
        "losses": losses,
        "norms": [o["grad_norm"] for o in outs],
        "weights": weights,
        "moments": moments,
        "started": started,
    }


def _bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert a["moments"].keys() == b["moments"].keys() and a["moments"]
    for n, w in a["weights"].items():
        assert torch.equal(w, b["weights"][n]), n
        for k, m in a["moments"][n].items():
            assert torch.equal(m, b["moments"][n][k]), (n, k)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(bf16=True),
        dict(bf16=True, optimizer="lion"),
        dict(optimizer="adafactor"),
        dict(bf16=True, host_optimizer_threads=2),
    ],
    ids=["fp32-adamw", "bf16-adamw", "bf16-lion", "fp32-adafactor", "bf16-2-threads"],
)
def test_early_host_step_is_bitwise_the_serial_one(kw):
    ps = ParallelState.single()
    serial, early = _train(ps, False, **kw), _train(ps, True, **kw)
    assert early["started"] == [2, 2, 2]  # both offloaded layers started before backward ended
    _bitwise(serial, early)


def test_next_forward_waits_for_each_early_step():
    """Each layer's step takes 0.2 s: backward ends, and the next forward reaches layers 0 and 2,
    while they still step."""
    ps = ParallelState.single()
    _bitwise(_train(ps, False), _train(ps, True, slow=0.2, host_optimizer_threads=2))


@pytest.mark.parametrize("kw", [dict(clip_grad=1.0), dict(fp16=True), dict(bf16=True, clip_grad=0.5)])
def test_after_the_norm_when_something_global_gates_the_update(kw):
    ps = ParallelState.single()
    assert _train(ps, True, steps=1, **kw)["started"] == []  # the DDP reports nothing: no early start


def test_non_finite_gradient_is_an_error(monkeypatch):
    """The serial step would be skipped; the early one cannot be."""
    from megatron_p2r.training import step as training

    real = training.grad_norm_and_non_finite
    monkeypatch.setattr(training, "grad_norm_and_non_finite", lambda *a: (real(*a)[0], True))
    with pytest.raises(RuntimeError, match="non-finite gradient in a step whose offloaded layers were already"):
        _train(ParallelState.single(), True, steps=1)


def _dp2(rank, world):
    ps, _ = setup_parallel(tiny_config(**BASE), torch.device("cpu"))
    started = {}
    for label, kw in [
        ("overlap-grad-reduce", dict(overlap_grad_reduce=True)),
        ("bf16-2-threads", dict(bf16=True, host_optimizer_threads=2)),
    ]:
        serial, early = _train(ps, False, **kw), _train(ps, True, **kw)
        _bitwise(serial, early)
        started[label] = early["started"]
    return started


def _pp2(rank, world):
    kw = dict(pipeline_model_parallel_size=2, global_batch_size=8, bf16=True)
    ps, _ = setup_parallel(tiny_config(**{**BASE, **kw}), torch.device("cpu"))
    serial, early = _train(ps, False, **kw), _train(ps, True, **kw)
    _bitwise(serial, early)
    return early["started"]


def test_pp2_early_host_step_is_bitwise_the_serial_one():
    """1F1B over 8 micro-batches: each stage's offloaded layer starts in its last backward."""
    assert run_distributed(_pp2, 2) == [[1, 1, 1], [1, 1, 1]]


def test_dp2_early_host_step_is_bitwise_the_serial_one():
    """With --overlap-grad-reduce the steps start in backward, each after its bucket's all-reduce;
    without it the buckets are reduced after backward, and the steps start then."""
    for started in run_distributed(_dp2, 2):
        assert started == {"overlap-grad-reduce": [2, 2, 2], "bf16-2-threads": [0, 0, 0]}


def test_host_optimizer_threads_auto_is_the_ranks_share_of_the_cores(monkeypatch):
    """auto: the cores divided by the node's local ranks (at least 1); N as given; the serial step
    takes them too (no --overlap needed); anything else is one error naming the flag."""
    from megatron_p2r.config import ConfigError, validate
    from megatron_p2r.config.offload import host_optimizer_threads

    assert host_optimizer_threads("auto", cores=16, local_ranks=8) == 2
    assert host_optimizer_threads("auto", cores=4, local_ranks=8) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_optimizer_threads("auto", cores=12) == 6
    assert host_optimizer_threads("3") == 3
    validate(tiny_config(**BASE, host_optimizer_threads=2), 1)
    for bad in ("0", "many", "-1"):
        with pytest.raises(ConfigError, match="--host-optimizer-threads: expected auto or a count"):
            validate(tiny_config(**BASE, host_optimizer_threads=bad), 1)


def test_resume_is_bitwise(tmp_path):
    """3 steps straight, or 2, save, load into a fresh run (the layer optimizers over the loaded state) and 1 more."""
    from megatron_p2r.checkpoint.io import save_checkpoint

    cfg = tiny_config(**BASE, bf16=True, overlap_cpu_optimizer_d2h_h2d=True, host_optimizer_threads=2)
    ps = ParallelState.single()
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    straight, full = run_steps(cfg, ps, 3)
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    first, half = run_steps(cfg, ps, 2)
    save_checkpoint(str(tmp_path), half)
    second, resumed = run_steps(cfg, ps, 1, load=str(tmp_path))
    assert first + second == straight
    full.optimizer.finish_host_step()
    resumed.optimizer.finish_host_step()
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), n
