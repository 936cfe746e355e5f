"""The parallel section: TP/PP/EP sizes, the pipeline split, data-parallel gradient reduction and
the distributed optimizer (Megatron-LM's flags and defaults), backend and device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_p2r.config.fields import ConfigError, opt, require_at_least_one


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "TP: shards of every layer's matrices.")
    pipeline_model_parallel_size: int = opt(1, "PP: pipeline stages.")
    expert_model_parallel_size: int = opt(1, "EP: ranks the experts are spread over (divides DP).")
    pipeline_layer_split: Optional[str] = opt(None, "Layers per stage, e.g. 3,5,5,3 (default even).")
    pipeline_schedule: str = opt("1f1b", "Pipeline schedule.", choices=["1f1b", "gpipe"])
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism: norms, dropouts and residuals hold "
                                         "1/TP of the sequence (no effect with TP 1, as in Megatron-LM).")
    distributed_backend: str = opt("auto", "torch.distributed backend (auto: nccl on CUDA, gloo on CPU).",
                                   choices=["auto", "gloo", "nccl"])
    distributed_timeout_minutes: float = opt(10.0, "Timeout of every collective.")
    device: str = opt("auto", "Compute device (auto: cuda when available, else cpu).", choices=["auto", "cpu", "cuda"])
    use_distributed_optimizer: bool = opt(False, "Shard fp32 master weights and Adam moments over data parallelism "
                                                 "(ZeRO-1): reduce-scatter gradients, all-gather weights.")
    overlap_grad_reduce: bool = opt(False, "Reduce gradient buckets asynchronously as they become final in backward.")
    overlap_param_gather: bool = opt(False, "With the distributed optimizer: all-gather updated weights "
                                            "asynchronously, waited on by the next forward.")
    ddp_bucket_size: Optional[int] = opt(None, "Elements per gradient bucket (default with --overlap-grad-reduce: "
                                               "max(4e7, 1e6 x DP); without it one bucket per buffer).")

    def check(self, num_layers: int) -> None:
        """Sizes >= 1, a pipeline split that gives every stage a layer, overlap flags that can work."""
        require_at_least_one(("--tensor-model-parallel-size", self.tensor_model_parallel_size),
                             ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
                             ("--expert-model-parallel-size", self.expert_model_parallel_size),
                             ("--ddp-bucket-size", self.ddp_bucket_size))
        stage_layer_counts(num_layers, self.pipeline_model_parallel_size, self.pipeline_layer_split)
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
                              "(as in Megatron-LM)")


def stage_layer_counts(num_layers: int, pp: int, split: Optional[str] = None) -> List[int]:
    """Layers per stage: even (earlier stages take the remainder) or an explicit '3,5,5,3'."""
    if split:
        try:
            counts = [int(x) for x in split.split(",")]
        except ValueError:
            raise ConfigError(f"--pipeline-layer-split {split!r}: expected comma-separated integers") from None
        if len(counts) != pp:
            raise ConfigError(f"--pipeline-layer-split {split!r} has {len(counts)} entries but "
                              f"--pipeline-model-parallel-size is {pp}")
        if any(c < 1 for c in counts):
            raise ConfigError(f"--pipeline-layer-split {split!r}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ConfigError(f"--pipeline-layer-split {split!r} adds up to {sum(counts)}, "
                              f"but --num-layers is {num_layers}")
        return counts
    if pp > num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size ({pp}) exceeds --num-layers ({num_layers}): "
                          "a stage would be empty")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]
