"""The parallel section: TP/PP/EP/CP sizes, the pipeline split, data-parallel gradient reduction and
the distributed optimizer (Megatron-LM's flags and defaults), backend and device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import LAYERS, at_least


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "TP: shards of every layer's matrices.")
    pipeline_model_parallel_size: int = opt(1, "PP: pipeline stages.")
    expert_model_parallel_size: int = opt(1, "EP: ranks the experts are spread over (divides DP).")
    context_parallel_size: int = opt(
        1,
        "CP: ranks each micro-batch's sequence is split over (load-balanced for the causal mask: a rank "
        "holds chunks i and 2CP-1-i of 2CP); --seq-length must be a multiple of 2CP.",
    )
    cp_comm_type: str = opt(
        "p2p",
        "How attention exchanges keys and values over the CP ranks: p2p (a ring), a2a (Ulysses), allgather.",
        choices=["p2p", "a2a", "allgather"],
    )
    pipeline_layer_split: Optional[str] = opt(None, "Layers per stage, e.g. 3,5,5,3 (default even).")
    pipeline_schedule: str = opt("1f1b", "Pipeline schedule.", choices=["1f1b", "gpipe"])
    sequence_parallel: bool = opt(
        False,
        "Megatron sequence parallelism: norms, dropouts and residuals hold "
        "1/TP of the sequence (no effect with TP 1, as in Megatron-LM).",
    )
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(
        None, "Layers per virtual pipeline stage: interleaved 1F1B with (L/P)/N model chunks per rank."
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = opt(
        None,
        "Model chunks per pipeline rank (interleaved 1F1B); the alternative to "
        "--num-layers-per-virtual-pipeline-stage.",
    )
    distributed_backend: str = opt(
        "auto", "torch.distributed backend (auto: nccl on CUDA, gloo on CPU).", choices=["auto", "gloo", "nccl"]
    )
    distributed_timeout_minutes: float = opt(10.0, "Timeout of every collective.")
    device: str = opt("auto", "Compute device (auto: cuda when available, else cpu).", choices=["auto", "cpu", "cuda"])
    use_distributed_optimizer: bool = opt(
        False,
        "Shard fp32 master weights and Adam moments over data parallelism "
        "(ZeRO-1): reduce-scatter gradients, all-gather weights.",
    )
    overlap_grad_reduce: bool = opt(False, "Reduce gradient buckets asynchronously as they become final in backward.")
    overlap_param_gather: bool = opt(
        False,
        "With the distributed optimizer: all-gather updated weights asynchronously, waited on by the next forward.",
    )
    overlap_p2p_communication: bool = opt(
        True,
        "Interleaved 1F1B: post each op's pipeline receives while the op before it computes, so the "
        "transfers overlap compute (Megatron-LM's default; no effect without interleaving, as there).",
        on_flag=True,
    )
    overlap_moe_expert_parallel_comm: bool = opt(
        False,
        "Overlap the expert all-to-alls of one micro-batch with another micro-batch's compute: the forward "
        "of micro-batch i+1 runs with the backward of micro-batch i (needs EP > 1; one pipeline stage).",
    )
    ddp_bucket_size: Optional[int] = opt(
        None,
        "Elements per gradient bucket (default with --overlap-grad-reduce: "
        "max(4e7, 1e6 x DP); without it one bucket per buffer).",
    )

    def check(self, num_layers: int) -> None:
        """A pipeline split that gives every stage a layer, overlap flags that can work (each size's
        range: ``RANGES``)."""
        stage_layer_counts(num_layers, self.pipeline_model_parallel_size, self.pipeline_layer_split)
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)"
            )
        self.num_model_chunks(num_layers)

    def num_model_chunks(self, num_layers: int) -> int:
        """Model chunks (virtual stages) per pipeline rank: Megatron-LM's
        virtual_pipeline_model_parallel_size, 1 without interleaving. Checked as Megatron checks it:
        every virtual stage holds L / (P x v) layers."""
        per_stage, chunks = self.num_layers_per_virtual_pipeline_stage, self.num_virtual_stages_per_pipeline_rank
        if per_stage is None and chunks is None:
            return 1
        if per_stage is not None and chunks is not None:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                "are two ways to ask for interleaving: pass at most one"
            )
        pp, flag = (
            self.pipeline_model_parallel_size,
            ("--num-layers-per-virtual-pipeline-stage" if per_stage else "--num-virtual-stages-per-pipeline-rank"),
        )
        if num_layers % pp:
            raise ConfigError(
                f"{flag} needs --num-layers ({num_layers}) divisible by --pipeline-model-parallel-size ({pp})"
            )
        if per_stage is not None:
            if (num_layers // pp) % per_stage:
                raise ConfigError(
                    f"--num-layers-per-virtual-pipeline-stage {per_stage} must divide the "
                    f"{num_layers // pp} layers of each pipeline stage (--num-layers / "
                    f"--pipeline-model-parallel-size)"
                )
            chunks = num_layers // pp // per_stage
        elif (num_layers // pp) % chunks:
            raise ConfigError(
                f"--num-virtual-stages-per-pipeline-rank {chunks} must divide the {num_layers // pp} "
                f"layers of each pipeline stage (--num-layers / --pipeline-model-parallel-size)"
            )
        if chunks > 1 and pp == 1:
            raise ConfigError(f"{flag}: interleaving needs --pipeline-model-parallel-size > 1")
        if chunks > 1 and self.pipeline_layer_split:
            raise ConfigError(
                f"{flag} splits the layers evenly over the virtual stages; it cannot be combined "
                "with --pipeline-layer-split"
            )
        return chunks


def stage_layer_counts(num_layers: int, pp: int, split: Optional[str] = None) -> List[int]:
    """Layers per stage: even (earlier stages take the remainder) or an explicit '3,5,5,3'."""
    if split:
        try:
            counts = [int(x) for x in split.split(",")]
        except ValueError:
            raise ConfigError(f"--pipeline-layer-split {split!r}: expected comma-separated integers") from None
        if len(counts) != pp:
            raise ConfigError(
                f"--pipeline-layer-split {split!r} has {len(counts)} entries but --pipeline-model-parallel-size is {pp}"
            )
        if any(c < 1 for c in counts):
            raise ConfigError(f"--pipeline-layer-split {split!r}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ConfigError(
                f"--pipeline-layer-split {split!r} adds up to {sum(counts)}, but --num-layers is {num_layers}"
            )
        return counts
    if pp > num_layers:
        raise ConfigError(
            f"--pipeline-model-parallel-size ({pp}) exceeds --num-layers ({num_layers}): a stage would be empty"
        )
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


# Type and range of every numeric field (config/ranges.py); the rules between fields are in ``check``.
RANGES = {
    "tensor_model_parallel_size": at_least(1, 2**13),
    "pipeline_model_parallel_size": at_least(1, 2**13),
    "expert_model_parallel_size": at_least(1, 2**13),
    "context_parallel_size": at_least(1, 2**13),
    "ddp_bucket_size": at_least(1),  # elements: a threshold where a bucket closes, never allocated as such
    # below a second nothing completes (even the rendezvous); a datetime.timedelta overflows near 10^12
    "distributed_timeout_minutes": at_least(0.01, 10**6),
    "num_layers_per_virtual_pipeline_stage": at_least(1, LAYERS),
    "num_virtual_stages_per_pipeline_rank": at_least(1, LAYERS),
}
