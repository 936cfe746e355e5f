"""What offloading does on CUDA besides fetching weights (tests/cuda/test_offload.py): the
offloaded layers' 16-bit gradients copied device-to-host into pinned buffers, the host step
started in backward with CUDA tensors on the device side, the delayed update's second gradient
buffer pinned on host, the NVMe tier, and optimizer-only offload (``--cpu-offload-what
optimizer``: the device weights' state stepped on host). Each against the same run on CPU
(``tests/cuda/compare.py``) and, where two settings must agree exactly, bitwise on the device.
"""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_p2r.offload.runtime import OffloadManager  # noqa: E402
from tests.cuda.compare import assert_16bit_close, assert_fp32_close, count_calls, cpu_run, train  # noqa: E402

pytestmark = pytest.mark.cuda

# Layers 0 and 2 of 4 on host; the learning rate changes every step.
HOST = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=512,
    micro_batch_size=2,
    global_batch_size=4,
    lr=1e-3,
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    weight_decay=0.1,
    cpu_offload_layers="0,2",
    bf16=True,
)
OVERLAP = dict(overlap_cpu_optimizer_d2h_h2d=True)
STEPS = 3


def host_params(state) -> list:
    """The offloaded layers' weights (host tensors; in a dry run everything is on CPU anyway)."""
    return [p for p in state.model.parameters() if id(p) in state.offload.fetched_param_ids]


def settled(lane, values: dict, steps: int = STEPS):
    """Train on the lane's device; wait for an overlapped or delayed host step to finish."""
    cfg = lane.config(values)
    losses, grads, state = train(cfg, lane.parallel(cfg), steps)
    state.optimizer.finish_host_step()
    return losses, grads, state


def resident_grads(run) -> dict:
    """The first-step gradients of the device-resident layers: an overlapped or delayed host step
    zeroes its layers' gradients on its own threads once it has stepped on them, so what a
    callback after the step sees of those is a race (the host layers are compared bitwise with
    the serial step instead)."""
    _, grads, state = run
    on_host = {n for n, p in state.model.named_parameters() if id(p) in state.offload.offloaded_param_ids}
    return {n: g for n, g in grads.items() if n not in on_host}


def assert_bitwise(a, b) -> None:
    """Two runs on the device: same losses, same weights."""
    (losses_a, _, state_a), (losses_b, _, state_b) = a, b
    assert losses_a == losses_b, (losses_a, losses_b)
    weights_b = dict(state_b.model.named_parameters())
    assert not [n for n, p in state_a.model.named_parameters() if not torch.equal(p, weights_b[n])]


def test_offloaded_bf16_gradients_go_to_pinned_host_buffers(lane, record_property, monkeypatch):
    """``OffloadManager.to_host``: each offloaded layer's gradients leave the device in bf16 (the
    weights' dtype: half the PCIe bytes of fp32) into pinned buffers; the host gradient buckets
    they are reduced into are pinned too (``ParamAndGradBuffer._allocate``)."""
    copies = count_calls(
        monkeypatch,
        OffloadManager,
        "to_host",
        keep=lambda args, out: [(t.dtype, t.device.type, lane.cuda and t.is_pinned()) for t in out],
    )
    losses, grads, state = settled(lane, HOST)
    seen = {c for call in copies for c in call}
    record_property("host_gradient_copies", sorted(map(str, seen)))
    assert seen == {(torch.bfloat16, "cpu", lane.cuda)}, seen
    assert all(p.main_grad.device.type == "cpu" for p in host_params(state))
    if lane.cuda:
        assert all(p.main_grad.is_pinned() and p.is_pinned() for p in host_params(state))
    assert_16bit_close(record_property, HOST, STEPS, losses, grads, bf16=True)


def test_host_step_started_in_backward_is_bitwise_the_serial_one(lane, record_property):
    """``--overlap-cpu-optimizer-d2h-h2d`` without clipping starts each offloaded layer's host
    AdamW in backward, on threads, while CUDA computes the layers below: bitwise the serial host
    step on the same device, and the CPU run within 16-bit tolerance."""
    values = {**HOST, "clip_grad": 0.0}
    early = settled(lane, {**values, **OVERLAP, "host_optimizer_threads": 2})
    assert early[2].optimizer.inner["host"].early, "the host step must start in backward here"
    assert_bitwise(early, settled(lane, values))
    assert_16bit_close(record_property, {**values, **OVERLAP}, STEPS, early[0], resident_grads(early), bf16=True)


def test_delayed_update_second_gradient_buffer_is_pinned(lane, record_property):
    """``--cpu-offload-delayed-param-update``: the host step of iteration t reads one gradient
    buffer while iteration t+1 accumulates into the other (``BucketState.add_second_grad``),
    both pinned host memory on CUDA; the losses follow the same delayed run on CPU."""
    values = {
        **HOST,
        **OVERLAP,
        "cpu_offload_delayed_param_update": True,
        "cpu_offload_delayed_param_update_warmup_steps": 0,
        "clip_grad": 1.0,
    }
    run = losses, _, state = settled(lane, values, 4)
    second = [b.second_grad for buf in state.ddp.buffers for b in buf.buckets if b.second_grad is not None]
    record_property("second_gradient_buckets", len(second))
    assert second and all(t.device.type == "cpu" for t in second)
    if lane.cuda:
        assert all(t.is_pinned() for t in second)
    assert_16bit_close(record_property, values, 4, losses, resident_grads(run), bf16=True)


def test_nvme_tier_is_bitwise_the_ram_run(lane, record_property, tmp_path):
    """``--cpu-offload-optimizer-nvme-path``: the host step's mains and moments in a mapped file
    instead of RAM, the device side on CUDA: bitwise the RAM run on the same device."""
    nvme = settled(lane, {**HOST, **OVERLAP, "cpu_offload_optimizer_nvme_path": str(tmp_path)})
    assert nvme[2].offload.nvme is not None
    record_property("nvme_file_bytes", nvme[2].offload.describe().get("nvme"))
    assert_bitwise(nvme, settled(lane, {**HOST, **OVERLAP}))
    assert_16bit_close(record_property, {**HOST, **OVERLAP}, STEPS, nvme[0], resident_grads(nvme), bf16=True)


def test_optimizer_only_offload_steps_on_host(lane, record_property):
    """``--cpu-offload-what optimizer`` (fp32): weights stay on the device, their AdamW state on
    host; each step copies mains and gradients device-to-host (``StagedOptimizer._on_host``) and
    back. Against the same run on CPU in fp32 tolerance."""
    values = {**HOST, "bf16": False, "cpu_offload_what": "optimizer"}
    losses, grads, state = settled(lane, values)
    assert not host_params(state)
    assert "staged" in state.optimizer.inner, state.optimizer.inner
    ref_losses, ref_grads, _ = cpu_run(values, STEPS)
    assert_fp32_close(record_property, losses, grads, ref_losses, ref_grads)
