"""Training, one module per concern:

- ``launch``: a run's start (device, process group, validated config, ParallelPlan, groups, seeds);
- ``state``: what a run holds (``TrainState``) and how it is built;
- ``data``: its datasets and this rank's micro-batches;
- ``step``: one optimizer step (``train_step``);
- ``evaluation``: the validation loss;
- ``saving``: the loop's checkpoint and exit hooks;
- ``loop``: ``pretrain`` (what ``pretrain_m6.py`` runs under torchrun) and ``train``.

The names below are the package's API: tests, benchmarks and tools drive the parts in-process.
"""

from megatron_p2r.training.data import build_datasets, microbatch_iterator
from megatron_p2r.training.evaluation import evaluate
from megatron_p2r.training.launch import init_distributed, resolve_device, resolve_vocab, setup_parallel
from megatron_p2r.training.loop import log_rank, pretrain, train
from megatron_p2r.training.saving import ExitSignal
from megatron_p2r.training.state import TrainingStopped, TrainState, build_train_state, describe_memory
from megatron_p2r.training.step import reduce_loss, train_step

__all__ = [
    "build_datasets",
    "microbatch_iterator",
    "evaluate",
    "init_distributed",
    "resolve_device",
    "resolve_vocab",
    "setup_parallel",
    "log_rank",
    "pretrain",
    "train",
    "ExitSignal",
    "TrainingStopped",
    "TrainState",
    "build_train_state",
    "describe_memory",
    "reduce_loss",
    "train_step",
]
