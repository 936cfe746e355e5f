"""The registry of CUDA-only code: every construct of the package whose behaviour depends on the
device being CUDA (found by ``tests/cuda/scan.py``), and the lane test that runs it on a GPU.

One line per (file under megatron_p2r/, anchor, construct): the anchor is the enclosing
function's qualified name (``Class.method``; ``<module>`` at top level), never a line number. A
construct the scan finds without a line here fails tests/test_cuda_registry.py, whose message is
the line to add (with a lane test that runs it: an existing one, or a new one in tests/cuda); a
line whose construct the scan no longer finds, or whose test does not exist, fails it too.

``BEHAVIOURS`` holds what differs on CUDA without a construct the scan can see (code that only
handles CUDA tensors made elsewhere): checked for its anchor still existing and its test.
"""

from __future__ import annotations

from typing import NamedTuple


class E(NamedTuple):
    file: str  # under megatron_p2r/
    anchor: str  # qualified name of the enclosing function or class
    construct: str  # as tests/cuda/scan.py names it (BEHAVIOURS: what is CUDA-specific)
    test: str  # the lane test that runs it on CUDA: tests/cuda/<module>.py::<test>[<param id>]


NUMERICS = "tests/cuda/test_numerics.py::test_training_step_matches_cpu_fp32_reference[bf16]"
BUSY = "tests/cuda/test_numerics.py::test_busy_timer_synchronizes_and_changes_nothing"
RESUME = "tests/cuda/test_resume.py::test_resume_is_bitwise_with_cuda_rng_and_dropout"
ASYNC_SAVE = "tests/cuda/test_checkpoint.py::test_async_save_copies_to_host_before_training_goes_on"
PREFLIGHT = "tests/cuda/test_checkpoint.py::test_preflight_reads_free_device_memory"
OFFLOAD_MEMORY = "tests/cuda/test_offload.py::test_offload_half_the_layers_same_losses_and_planned_memory_drop"
OFFLOAD_OVERLAP = "tests/cuda/test_offload.py::test_offload_prefetch_copies_overlap_compute"
HOST_GRADS = "tests/cuda/test_host_paths.py::test_offloaded_bf16_gradients_go_to_pinned_host_buffers"
HOST_EARLY = "tests/cuda/test_host_paths.py::test_host_step_started_in_backward_is_bitwise_the_serial_one"
DELAYED = "tests/cuda/test_host_paths.py::test_delayed_update_second_gradient_buffer_is_pinned"
NVME = "tests/cuda/test_host_paths.py::test_nvme_tier_is_bitwise_the_ram_run"
STAGED = "tests/cuda/test_host_paths.py::test_optimizer_only_offload_steps_on_host"
MOE_NCCL = "tests/cuda/test_moe.py::test_moe_forward_backward_through_nccl_all_to_all"
GROUPED = "tests/cuda/test_moe.py::test_grouped_gemm_experts_match_padded_bmm_and_cpu"
SDPA = "tests/cuda/test_kernels.py::test_sdpa_kernel_with_dropout_replays_its_masks"
FP16 = "tests/cuda/test_kernels.py::test_fp16_loss_scaling_skips_on_cuda_infs_and_trains_after"
PRECISION_AWARE = "tests/cuda/test_kernels.py::test_precision_aware_adamw_fused_kernel_on_bf16_moments"
COMPILE = "tests/cuda/test_kernels.py::test_compile_inductor_cuda_codegen_matches_eager"
PLANNER = "tests/cuda/test_planner_memory.py::test_activation_estimate_matches_cuda_allocator"
GLOO_CUDA = "tests/cuda/test_multirank.py::test_dp2_gloo_over_cuda_tensors_on_one_gpu"
NCCL_2GPU = "tests/cuda/test_multirank.py::test_nccl_two_gpus"
PROFILER_TRACE = "tests/cuda/test_profiling.py::test_pytorch_profiler_traces_cuda_kernels_of_the_chosen_steps"
NSYS_RANGE = "tests/cuda/test_profiling.py::test_nsys_range_brackets_steps_after_start_to_end"
MEMORY_SNAPSHOT = "tests/cuda/test_profiling.py::test_memory_snapshot_holds_the_allocators_history"
MLA = "tests/cuda/test_kernels.py::test_latent_attention_trains_like_cpu"
EXPERT_BIAS = "tests/cuda/test_moe.py::test_expert_bias_updates_on_cuda_as_on_cpu"
LOGGING = "tests/cuda/test_numerics.py::test_logging_reads_the_allocator_and_times_whole_kernels"
CP_BLOCK = "tests/cuda/test_context.py::test_ring_block_kernel_matches_sdpa_on_the_block"
CP_SINKS = "tests/cuda/test_context.py::test_sink_aware_sdpa_matches_the_cpu"

CUDA_ONLY = [
    E("checkpoint/async_save.py", "host_copy", '.to("cpu")', ASYNC_SAVE),
    E("checkpoint/expert_bias.py", "collect_expert_biases", ".cpu()", EXPERT_BIAS),
    E("checkpoint/io.py", "_load_rng", 'device == "cuda"', RESUME),
    E("checkpoint/io.py", "_load_rng", "torch.cuda.set_rng_state", RESUME),
    E("checkpoint/io.py", "_rng_tensors", 'device == "cuda"', RESUME),
    E("checkpoint/io.py", "_rng_tensors", "torch.cuda.get_rng_state", RESUME),
    E("checkpoint/safetensors_io.py", "ShardWriter.write", '.to("cpu")', RESUME),
    E("context/attention.py", "sdpa_with_sinks", "scaled_dot_product_attention", CP_SINKS),
    E("context/kernels.py", "_uses_flash", 'device == "cpu"', CP_BLOCK),
    E("lifecycle.py", "check_run_fits", 'device == "cuda"', PREFLIGHT),
    E("lifecycle.py", "check_run_fits", "torch.cuda.mem_get_info", PREFLIGHT),
    E("metrics.py", "peak_memory_bytes", 'device == "cuda"', NUMERICS),
    E("metrics.py", "peak_memory_bytes", "torch.cuda.max_memory_allocated", NUMERICS),
    E("model/attention.py", "Attention.core", "scaled_dot_product_attention", SDPA),
    E("model/latent_attention.py", "LatentAttention.core", "scaled_dot_product_attention", MLA),
    E("model/compiled.py", "CompiledForward.__call__", "torch.compile", COMPILE),
    E("model/compiled.py", "CompiledForward.__init__", "torch.compile", COMPILE),
    E("moe/grouped_mm.py", "grouped_matmul", "grouped_mm", GROUPED + "[gelu]"),
    E("moe/grouped_swiglu.py", "_GroupedSwiGLU.backward", "grouped_mm", GROUPED + "[swiglu]"),
    E("moe/grouped_swiglu.py", "_GroupedSwiGLU.forward", "grouped_mm", GROUPED + "[swiglu]"),
    E("offload/__init__.py", "apply_offload", ".pin_memory()", OFFLOAD_MEMORY),
    E("offload/__init__.py", "apply_offload", 'device != "cpu"', OFFLOAD_MEMORY),
    E("offload/runtime.py", "OffloadManager.__init__", 'device == "cuda"', OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager.__init__", "torch.cuda.Stream", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager._copy", "non_blocking=True", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager._copy", "torch.cuda.Event", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager._copy", "torch.cuda.stream", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager.acquire", ".record_stream()", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager.acquire", ".wait_event()", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager.acquire", "torch.cuda.current_stream", OFFLOAD_OVERLAP),
    E("offload/runtime.py", "OffloadManager.to_host", "non_blocking=True", HOST_GRADS),
    E("offload/runtime.py", "OffloadManager.to_host", "pin_memory=True", HOST_GRADS),
    E("offload/runtime.py", "OffloadManager.to_host", "torch.cuda.current_stream", HOST_GRADS),
    E("optim/adafactor.py", "Adafactor._reduce", ".cpu()", NCCL_2GPU + "[tp2-adafactor]"),
    E("optim/host_kernels.py", "_call", 'device != "cpu"', PRECISION_AWARE),
    E("optim/host_kernels.py", "steps", 'device == "cpu"', PRECISION_AWARE),
    E("optim/optimizer.py", "StagedOptimizer._on_host", '.to("cpu")', STAGED),
    E("optim/precision_aware.py", "PrecisionAwareAdamW._step_param", "fused=True", PRECISION_AWARE),
    E("optim/precision_aware.py", "PrecisionAwareAdamW._step_whole", "fused=True", NUMERICS),
    E("parallel/grad_buffer.py", "BucketState.add_second_grad", ".pin_memory()", DELAYED),
    E("parallel/grad_buffer.py", "BucketState.add_second_grad", 'device == "cpu"', DELAYED),
    E("parallel/grad_buffer.py", "BucketState.add_second_grad", 'device == "cuda"', DELAYED),
    E("parallel/grad_buffer.py", "ParamAndGradBuffer._allocate", ".pin_memory()", HOST_GRADS),
    E("parallel/grad_buffer.py", "ParamAndGradBuffer._allocate", 'device == "cpu"', HOST_GRADS),
    E("parallel/grad_buffer.py", "ParamAndGradBuffer._allocate", 'device == "cuda"', HOST_GRADS),
    E("parallel/mappings.py", "start_all_to_all", 'backend != "gloo"', MOE_NCCL),
    E("parallel/random.py", "RNGStatesTracker._get", 'device == "cuda"', RESUME),
    E("parallel/random.py", "RNGStatesTracker._get", "torch.cuda.get_rng_state", RESUME),
    E("parallel/random.py", "RNGStatesTracker._set", 'device == "cuda"', RESUME),
    E("parallel/random.py", "RNGStatesTracker._set", "torch.cuda.set_rng_state", RESUME),
    E("parallel/random.py", "gen_seed", 'device == "cuda"', RESUME),
    E("parallel/random.py", "gen_seed", "torch.cuda.manual_seed", RESUME),
    E("pipeline/schedules.py", "_BusyTimer._sync", 'device == "cuda"', BUSY),
    E("pipeline/schedules.py", "_BusyTimer._sync", "torch.cuda.synchronize", BUSY),
    E("planning/activations.py", "_embedding_bytes", 'device == "cuda"', PLANNER + "[bf16]"),
    E("planning/activations.py", "layer_activations", 'device == "cuda"', PLANNER + "[bf16]"),
    E("planning/activations.py", "latent_math_attention", 'device != "cuda"', PLANNER + "[bf16_mla]"),
    E("planning/activations.py", "math_attention", 'device != "cuda"', PLANNER + "[bf16_dropout]"),
    E("planning/activations.py", "sinks_unmodelled", 'device != "cuda"', PLANNER + "[bf16]"),
    E("planning/preflight.py", "rank_memory", 'device == "cuda"', PREFLIGHT),
    E("training/diagnostics.py", "memory_scalars", 'device == "cuda"', LOGGING),
    E("training/diagnostics.py", "memory_scalars", "torch.cuda.memory_stats", LOGGING),
    E("training/launch.py", "init_distributed", 'backend == "nccl"', NUMERICS),
    E("training/launch.py", "init_distributed", 'device != "cuda"', NUMERICS),
    E("training/launch.py", "init_distributed", 'device == "cuda"', NUMERICS),
    E("training/launch.py", "resolve_device", 'device == "cuda"', NUMERICS),
    E("training/launch.py", "resolve_device", "torch.cuda.is_available", NUMERICS),
    E("training/launch.py", "resolve_device", "torch.cuda.set_device", NUMERICS),
    E("training/launch.py", "resolve_device", 'torch.device("cuda")', NUMERICS),
    E("training/profiling.py", "StepProfiler.__init__", 'device == "cuda"', PROFILER_TRACE),
    E("training/profiling.py", "StepProfiler._stop", "torch.cuda.profiler", NSYS_RANGE),
    E("training/profiling.py", "StepProfiler.before_step", "torch.cuda.profiler", NSYS_RANGE),
    E("training/profiling.py", "dump_memory_snapshot", "torch.cuda.memory", MEMORY_SNAPSHOT),
    E("training/profiling.py", "start_memory_history", 'device != "cuda"', MEMORY_SNAPSHOT),
    E("training/profiling.py", "start_memory_history", "torch.cuda.memory", MEMORY_SNAPSHOT),
    E("training/timers.py", "Timers._sync", 'device == "cuda"', LOGGING),
    E("training/timers.py", "Timers._sync", "torch.cuda.synchronize", LOGGING),
    E("training/timers.py", "Timers.report", ".cpu()", LOGGING),
]

BEHAVIOURS = [
    E("parallel/grads.py", "grad_norm_and_non_finite", "fp16 infs and NaNs produced by CUDA kernels", FP16),
    E(
        "optim/host_step.py",
        "HostStep",
        "host step started in backward while CUDA computes the layers below",
        HOST_EARLY,
    ),
    E("optim/delayed_update.py", "DelayedHostStep", "delayed host step reading a pinned gradient buffer", DELAYED),
    E("offload/nvme.py", "NvmeOptimizerState", "NVMe-mapped host state behind CUDA device weights", NVME),
    E(
        "parallel/ddp.py",
        "DistributedDataParallel",
        "gradient buckets all-reduced as CUDA tensors over gloo",
        GLOO_CUDA,
    ),
    E(
        "pipeline/a2a_overlap.py",
        "take_turns",
        "--overlap-moe-expert-parallel-comm: NCCL all-to-alls in flight while CUDA computes",
        NCCL_2GPU + "[ep2-overlap-moe-comm]",
    ),
    E(
        "parallel/grad_buffer.py",
        "ParamAndGradBuffer.start_grad_reduce",
        "the distributed optimizer's reduce-scatter (and all-gather) of CUDA buckets on NCCL",
        NCCL_2GPU + "[dp2-distributed-optimizer]",
    ),
    E(
        "parallel/mappings.py",
        "reduce_scatter_to_sequence_region",
        "tensor- and sequence-parallel collectives on NCCL",
        NCCL_2GPU + "[tp2-sequence-parallel]",
    ),
]


def main() -> int:
    """``python -m tests.cuda.registry``: the inventory (every construct the scan finds and the
    lane test that runs it, then the behaviours) and the audit's problems; exit 1 on any."""
    from tests.cuda.scan import audit, scan_package

    found = scan_package()
    tests = {(e.file, e.anchor, e.construct): e.test for e in CUDA_ONLY}
    print(
        f"{len(found)} CUDA-only constructs in megatron_p2r/ ({len({c.file for c in found})} files), "
        f"{len(BEHAVIOURS)} behaviours; {len({*tests.values(), *(b.test for b in BEHAVIOURS)})} lane tests name them"
    )
    print("| file | anchor | construct | lane test |\n|---|---|---|---|")
    for c in found:
        print(f"| {c.file} | {c.anchor} | `{c.construct}` | {tests.get(c.key, '**unregistered**')} |")
    for b in BEHAVIOURS:
        print(f"| {b.file} | {b.anchor} | {b.construct} | {b.test} |")
    problems = audit(found, CUDA_ONLY, BEHAVIOURS)
    print("\n".join(["", *problems]) if problems else "\nthe registry is complete")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
