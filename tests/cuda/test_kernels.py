"""Kernels only CUDA selects, each against the same run on CPU (``tests/cuda/compare.py``): SDPA's
flash and memory-efficient kernels with attention dropout, fp16 dynamic loss scaling fed by the
infs of CUDA kernels, the precision-aware AdamW's fused kernel on bf16 moments, multi-latent
attention's SDPA (value heads narrower than the keys'), and ``--compile``
through inductor's CUDA code generation (last: its compilation is the slowest part of the lane)."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import contextlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from megatron_p2r.model.compiled import CompiledForward  # noqa: E402
from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW  # noqa: E402
from tests.cuda.compare import assert_16bit_close, assert_fp32_close, cpu_run, grad_errors, relative, train  # noqa: E402
from tests.cuda.test_checkpoint import DROPOUT_LOSS  # noqa: E402
from tests.cuda.test_numerics import SHAPE  # noqa: E402

pytestmark = pytest.mark.cuda

# fp16 on CPU has no fast kernels: the fp16 test's CPU references (and dry run) at half the width and length
FP16 = {**SHAPE, "hidden_size": 64, "seq_length": 64, "fp16": True}
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_sdpa_kernel_with_dropout_replays_its_masks(lane, record_property, kernel):
    """Attention dropout in one SDPA kernel (only that one allowed: a kernel that cannot run
    fails the test, naming it): the same seed draws the same masks (first losses bitwise),
    selective recomputation replays them (the recomputed core gives the same loss, and the
    gradients within 1e-2), and the losses follow the CPU run's at the same dropout rate."""
    values = {**SHAPE, "bf16": True, "attention_dropout": 0.1}
    allowed = sdpa_kernel(KERNELS[kernel]) if lane.cuda else contextlib.nullcontext()  # CPU has one kernel
    with allowed:
        losses, grads, _ = train(lane.config(values), lane.parallel(lane.config(values)), 2)
        again, _, _ = train(lane.config(values), lane.parallel(lane.config(values)), 2)
        recomputed_cfg = lane.config({**values, "recompute_granularity": "selective"})
        recomputed, recomputed_grads, _ = train(recomputed_cfg, lane.parallel(recomputed_cfg), 2)
    cpu_losses, _, _ = cpu_run(values, 2)
    record_property("losses", {"device": losses, "again": again, "recomputed": recomputed, "cpu": cpu_losses})
    assert again[0] == losses[0] and recomputed[0] == losses[0], (losses, again, recomputed)
    assert max(grad_errors(recomputed_grads, grads).values()) < 1e-2
    assert max(relative(losses, cpu_losses)) < DROPOUT_LOSS, (losses, cpu_losses)


def test_fp16_loss_scaling_skips_on_cuda_infs_and_trains_after(lane, record_property):
    """``--fp16``: a loss scale of 2^30 overflows fp16 gradients by a wide margin, so the CUDA
    kernels' infs must make every step skip and halve the scale, as on CPU; at Megatron's 2^16
    nothing overflows and the run follows the CPU fp16 run."""
    overflow = {**FP16, "initial_loss_scale": 2.0**30, "hysteresis": 1}
    outputs, cpu_outputs = [], []
    cfg = lane.config(overflow)
    _, _, state = train(cfg, lane.parallel(cfg), 2, outputs)
    cpu_run(overflow, 2, cpu_outputs)
    record_property("skipped", {"device": [o["skipped"] for o in outputs], "cpu": [o["skipped"] for o in cpu_outputs]})
    assert [o["skipped"] for o in outputs] == [o["skipped"] for o in cpu_outputs] == [True] * 2
    assert all(math.isnan(o["grad_norm"]) for o in outputs) and state.scaler.scale == 2.0**28
    finite = FP16
    outputs.clear()
    losses, grads, _ = train(lane.config(finite), lane.parallel(lane.config(finite)), 2, outputs)
    assert not any(o["skipped"] for o in outputs)
    assert_16bit_close(record_property, finite, 2, losses, grads, fp16=True)


def test_precision_aware_adamw_fused_kernel_on_bf16_moments(lane, record_property):
    """``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``: torch's
    fused AdamW kernel on fp32 chunks of bf16 moments, on the device."""
    values = {
        **SHAPE,
        "bf16": True,
        "use_precision_aware_optimizer": True,
        "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "bf16",
    }
    cfg = lane.config(values)
    losses, grads, state = train(cfg, lane.parallel(cfg), 3)
    inner = state.optimizer.inner["device"]
    assert isinstance(inner, PrecisionAwareAdamW)
    moments = {v.dtype for s in inner.state.values() for k, v in s.items() if k.startswith("exp_avg")}
    assert moments == {torch.bfloat16}, moments
    assert_16bit_close(record_property, values, 3, losses, grads, bf16=True)


MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_head_dim=32,
    qk_pos_emb_head_dim=16,
    v_head_dim=32,
    qk_layernorm=True,
    position_embedding_type="rope",
    normalization="RMSNorm",
    rotary_scaling_factor=4.0,
    mscale_all_dim=0.8,
)


def test_latent_attention_trains_like_cpu(lane, record_property):
    """``--multi-latent-attention`` in fp32: SDPA with value heads narrower than the query/key
    heads and the YaRN-scaled softmax on CUDA's kernels, 3 steps against the CPU run."""
    values = {**SHAPE, **MLA}
    cfg = lane.config(values)
    losses, grads, _ = train(cfg, lane.parallel(cfg), 3)
    ref_losses, ref_grads, _ = cpu_run(values, 3, bf16=False)
    assert_fp32_close(record_property, losses, grads, ref_losses, ref_grads)


def test_compile_inductor_cuda_codegen_matches_eager(lane, record_property):
    """``--compile --bf16``: each layer's forward through inductor (its CUDA code generation on a
    GPU) in one graph, against the eager run on CPU."""
    values = {**SHAPE, "bf16": True}
    eager, _, _ = train(lane.config(values), lane.parallel(lane.config(values)), 1)
    lane.needs_cuda("inductor's CUDA code generation (the CPU suite compiles with aot_eager)")
    cfg = lane.config({**values, "compile": True})
    losses, grads, state = train(cfg, lane.parallel(cfg), 3)
    compiled = [layer.forward for layer in state.model.layers.values()]
    assert all(isinstance(f, CompiledForward) and f.pieces is None for f in compiled), "a layer fell back to pieces"
    record_property("first_loss_rel_err_vs_eager", relative(losses[:1], eager)[0])
    assert_16bit_close(record_property, values, 3, losses, grads, bf16=True)
