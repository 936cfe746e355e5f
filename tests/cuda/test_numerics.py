"""One-rank training on CUDA against the CPU fp32 reference (same weights, same data): what a
user runs first — ``--bf16`` with the default flags (fused AdamW, the fused SDPA kernels, the
CUDA RNG streams), then fp32. Tolerances: ``tests/cuda/compare.py``."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_p2r.metrics import peak_memory_bytes  # noqa: E402
from megatron_p2r.model.m6 import build_model  # noqa: E402
from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW  # noqa: E402
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining  # noqa: E402
from tests.cuda.compare import (
    GRAD_16BIT_FACTOR,
    GRAD_16BIT_FLOOR,
    LOSS_16BIT,
    assert_fp32_close,  # noqa: E402
    cpu_run,
    grad_errors,
    relative,
    train,
    worst,
)
from tests.helpers import random_microbatches  # noqa: E402

pytestmark = pytest.mark.cuda

# Small enough for the CPU reference and the dry run; head_dim 32 takes the fused SDPA kernels.
SHAPE = dict(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    seq_length=128,
    vocab_size=1000,
    micro_batch_size=4,
    global_batch_size=8,
    clip_grad=1.0,
    weight_decay=0.01,
    lr=1e-3,
)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_training_step_matches_cpu_fp32_reference(lane, record_property, bf16):
    values = {**SHAPE, "bf16": bf16}
    cfg = lane.config(values)
    losses, grads, state = train(cfg, lane.parallel(cfg), 3)
    ref_losses, ref_grads, _ = cpu_run(values, 3, bf16=False)
    # the device optimizer steps its all-fp32 weights with torch's fused AdamW (one multi-tensor call)
    inner = state.optimizer.inner["device"]
    assert isinstance(inner, PrecisionAwareAdamW) and set(inner.dtypes.values()) == {torch.float32}, inner
    # the log's peak memory: the allocator's peak on CUDA (the process's peak RSS on CPU)
    peak = peak_memory_bytes(lane.device)
    record_property("peak_memory_bytes", peak)
    assert peak > 0 and (not lane.cuda or peak == torch.cuda.max_memory_allocated(lane.device)), peak
    if not bf16:
        assert_fp32_close(record_property, losses, grads, ref_losses, ref_grads)
        return
    grad_err, loss_err = grad_errors(grads, ref_grads), relative(losses, ref_losses)
    record_property("loss_rel_err", [round(e, 8) for e in loss_err])
    record_property("grad_rel_err_worst", worst(grad_err))
    _, cpu_bf16_grads, _ = cpu_run(values, 1, bf16=True)
    cpu_err = grad_errors(cpu_bf16_grads, ref_grads)
    record_property("cpu_bf16_grad_rel_err_worst", worst(cpu_err))
    over = {
        n: (e, cpu_err[n]) for n, e in grad_err.items() if e >= max(GRAD_16BIT_FACTOR * cpu_err[n], GRAD_16BIT_FLOOR)
    }
    assert not over, f"gradients further from fp32 than 3x bf16 on CPU: {over}"
    assert max(loss_err) < LOSS_16BIT, (losses, ref_losses)


def test_busy_timer_synchronizes_and_changes_nothing(lane, record_property):
    """The schedules' compute timer (``stats=``, what the pipeline benchmarks read) synchronises
    the device around each piece of work: same loss bitwise as without it, time counted."""
    cfg = lane.config({**SHAPE, "bf16": True})
    model = build_model(cfg, lane.parallel(cfg))
    batches = [{k: v.to(lane.device) for k, v in mb.items()} for mb in random_microbatches(cfg, 2, 4)]
    plain = forward_backward_no_pipelining(model, batches, lane.parallel(cfg), forward_only=True)
    stats: dict = {}
    timed = forward_backward_no_pipelining(model, batches, lane.parallel(cfg), forward_only=True, stats=stats)
    record_property("stats", stats)
    assert torch.equal(plain, timed) and stats["busy_s"] > 0, (plain, timed, stats)


def test_logging_reads_the_allocator_and_times_whole_kernels(lane, record_property):
    """--log-memory-to-tensorboard's Megatron tags from the CUDA allocator (the CPU reports resident
    memory instead), and --timing-log-level's timers synchronize the device around a timed block
    (a kernel launched inside is counted until it ends)."""
    from megatron_p2r.training.diagnostics import memory_scalars
    from megatron_p2r.training.timers import Timers

    x = torch.randn(512, 512, device=lane.device)
    scalars = memory_scalars(lane.device)
    record_property("memory_scalars", scalars)
    if lane.cuda:
        assert set(scalars) == {
            "mem-reserved-bytes",
            "mem-allocated-bytes",
            "mem-max-allocated-bytes",
            "mem-allocated-count",
        }
        assert scalars["mem-allocated-bytes"] >= x.numel() * 4
        assert scalars["mem-allocated-bytes"] == torch.cuda.memory_stats(lane.device)["allocated_bytes.all.current"]
    else:
        assert scalars["mem-max-rss-bytes"] > 0
    timers = Timers(2, lane.device)
    with timers("forward-backward"):
        for _ in range(20):
            x = x @ x / 512
    report = timers.report(1)
    record_property("timed_seconds", report["forward-backward"])
    assert report["forward-backward"][0] > 0
