"""Configuration as frozen dataclasses, one module per section with its own rules.

Every field is also a Megatron-style command-line flag: the field ``num_layers`` is the flag
``--num-layers`` and the YAML key ``num-layers`` (or ``num_layers``). ``arguments.py`` builds
the parser from these fields, so a new option is added in exactly one place. The package
imports nothing else of megatron_p2r: flag syntax (share patterns, pipeline splits, offload
specs) is parsed here and the modules that act on it import the parsers.
"""

from megatron_p2r.config.checkpoint import CheckpointConfig
from megatron_p2r.config.data import DataConfig
from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.logging import LoggingConfig
from megatron_p2r.config.model import ModelConfig
from megatron_p2r.config.offload import (
    FULL,
    OPTIMIZER_ONLY,
    WHAT_ITEMS,
    LayerSpec,
    OffloadConfig,
    parse_layer_spec,
    parse_memory_size,
    parse_offload_what,
)
from megatron_p2r.config.optimizers import OPTIMIZERS, OptimizerSpec
from megatron_p2r.config.p2r import P2RConfig, parse_share_pattern
from megatron_p2r.config.profiling import ProfilingConfig
from megatron_p2r.config.parallel import ParallelConfig, stage_layer_counts
from megatron_p2r.config.batch import (
    data_parallel_size,
    global_batch_size,
    num_microbatches,
    train_iters,
    train_samples,
)
from megatron_p2r.config.root import SECTIONS, Config
from megatron_p2r.config.step_plan import StepPlan, build_step_plan
from megatron_p2r.config.train import TrainConfig
from megatron_p2r.config.validation import check_values, validate

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "P2RConfig",
    "DataConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "OffloadConfig",
    "ProfilingConfig",
    "SECTIONS",
    "validate",
    "check_values",
    "data_parallel_size",
    "num_microbatches",
    "global_batch_size",
    "train_iters",
    "train_samples",
    "parse_share_pattern",
    "stage_layer_counts",
    "parse_memory_size",
    "parse_offload_what",
    "LayerSpec",
    "parse_layer_spec",
    "WHAT_ITEMS",
    "FULL",
    "OPTIMIZER_ONLY",
    "OPTIMIZERS",
    "OptimizerSpec",
    "StepPlan",
    "build_step_plan",
]
