"""``validate``: each section's own rules, then the rules that join sections, each failing
with one message that names the flag(s)."""

from __future__ import annotations

import os

from megatron_p2r.config import checkpoint, data, logging, model, offload, p2r, parallel, profiling, train
from megatron_p2r.config.batch import (
    data_parallel_size,
    global_batch_size,
    lr_lengths,
    parse_step_schedule,
    train_iters,
)
from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.ranges import check_fields
from megatron_p2r.config.root import SECTIONS, Config
from megatron_p2r.config.schedule import schedule_plan
from megatron_p2r.config.step_plan import build_step_plan

# The table of each section's ranges, beside its dataclass.
RANGE_TABLES = {
    "model": model.RANGES,
    "parallel": parallel.RANGES,
    "train": train.RANGES,
    "p2r": p2r.RANGES,
    "data": data.RANGES,
    "checkpoint": checkpoint.RANGES,
    "logging": logging.RANGES,
    "offload": offload.RANGES,
    "profiling": profiling.RANGES,
}


def check_values(cfg: Config) -> None:
    """Type and range of every value (config/ranges.py), before any rule reads them."""
    for name in SECTIONS:
        check_fields(getattr(cfg, name), RANGE_TABLES[name])


def validate(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for the first inconsistent setting (one message per rule)."""
    check_values(cfg)
    m, p = cfg.model, cfg.parallel
    m.check()
    p.check(m.num_layers)
    m.check_split(p.tensor_model_parallel_size, p.expert_model_parallel_size)
    _check_world(cfg, world_size)
    _check_sequence_parallel(cfg)
    _check_context_parallel(cfg)
    _check_mtp(cfg)
    cfg.train.check()
    cfg.data.check()
    cfg.logging.check(cfg.checkpoint.save)
    cfg.profiling.check(world_size)
    _check_batch(cfg, world_size)
    _check_length(cfg, world_size)
    _check_inputs(cfg)
    _check_outputs(cfg)
    _check_paths(cfg)
    cfg.p2r.check(m.num_layers)
    cfg.offload.check(m.num_layers)
    build_step_plan(cfg)  # every refusal of how the optimizer steps
    schedule_plan(cfg)  # every refusal of a pipeline schedule
    if cfg.train.compile and (m.moe_router_enable_expert_bias or m.moe_shared_expert_intermediate_size):
        raise ConfigError(
            "--compile with --moe-router-enable-expert-bias or --moe-shared-expert-intermediate-size is not "
            "tested (compiled top-k MoE layers fail in torch's inductor here): drop --compile"
        )
    if cfg.checkpoint.async_save and not cfg.checkpoint.ckpt_fully_parallel_save:
        raise ConfigError(
            "--async-save needs the fully parallel save: every rank writes what it owns from a host "
            "copy; drop --no-ckpt-fully-parallel-save"
        )


def _check_world(cfg: Config, world_size: int) -> None:
    """The world splits into TP x CP x DP x PP, and EP divides DP x CP (Megatron's expert grid)."""
    p = cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    cp = p.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} must be divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {tp * pp * cp}"
        )
    dp = data_parallel_size(cfg, world_size)
    if (dp * cp) % ep:
        raise ConfigError(
            f"--expert-model-parallel-size ({ep}) must divide the data-parallel size x --context-parallel-size "
            f"({dp * cp} = world {world_size} / (TP {tp} x PP {pp}))"
        )


def _check_mtp(cfg: Config) -> None:
    """Multi-token prediction runs on the last stage, which needs the input embedding there: it
    holds a replica of the word embedding (tied or not), not of learned positions (docs/mtp.md)."""
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    if not m.mtp_num_layers:
        return
    if pp > 1 and m.position_embedding_type == "learned_absolute":
        raise ConfigError(
            "--mtp-num-layers with learned absolute positions and PP > 1: the position embedding is not "
            "replicated on the last stage; use --position-embedding-type rope or PP 1"
        )
    if m.window_size is not None:
        raise ConfigError("--mtp-num-layers with --window-size: the MTP layers' windows are not built")


def _check_sequence_parallel(cfg: Config) -> None:
    """Sequence parallelism splits every sample's sequence evenly over the TP ranks."""
    p, seq = cfg.parallel, cfg.model.seq_length
    if p.sequence_parallel and seq % p.tensor_model_parallel_size:
        raise ConfigError(
            f"--sequence-parallel: --seq-length ({seq}) must be divisible by "
            f"--tensor-model-parallel-size ({p.tensor_model_parallel_size})"
        )


def _check_context_parallel(cfg: Config) -> None:
    """Each CP rank holds two of 2CP equal chunks of every sequence (Megatron-LM's rule); the
    compositions not built with CP are refused by name (docs/context_parallel.md)."""
    p, seq = cfg.parallel, cfg.model.seq_length
    cp = p.context_parallel_size
    if cp == 1:
        return
    if seq % (2 * cp):
        raise ConfigError(f"--context-parallel-size {cp}: --seq-length ({seq}) must be a multiple of 2 x CP")
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and (seq // cp) % tp:
        raise ConfigError(
            f"--context-parallel-size {cp} with --sequence-parallel: a CP rank's {seq // cp} tokens "
            f"(--seq-length / CP) must split evenly over --tensor-model-parallel-size ({tp})"
        )
    m = cfg.model
    heads, kv_heads = m.num_attention_heads // tp, max(m.query_groups // tp, 1)  # a rank's
    if p.cp_comm_type == "a2a" and (heads % cp or kv_heads % cp):  # a2a scatters them over CP
        raise ConfigError(
            f"--cp-comm-type a2a: {heads} local attention heads and {kv_heads} local key/value heads "
            f"must both be divisible by the context-parallel size {cp}; use p2p or allgather"
        )
    refused = [
        (p.overlap_moe_expert_parallel_comm, "--overlap-moe-expert-parallel-comm"),
        (cfg.train.compile, "--compile"),
        (cfg.model.multi_latent_attention, "--multi-latent-attention"),
        (cfg.model.moe_router_load_balancing_type == "seq_aux_loss", "--moe-router-load-balancing-type seq_aux_loss"),
        (bool(cfg.model.mtp_num_layers), "--mtp-num-layers"),
        (cfg.model.attn_logit_softcapping is not None, "--attn-logit-softcapping"),
    ]
    for given, what in refused:
        if given:
            raise ConfigError(f"--context-parallel-size {cp} is not built with {what}; use --context-parallel-size 1")


def _check_batch(cfg: Config, world_size: int) -> None:
    """A global batch is a whole number of micro-batches on every DP rank (the final one here,
    a scheduled one when the step reaches it, as Megatron checks it); a step schedule ends at
    --global-batch-size when both are given."""
    t = cfg.train
    micro, dp = t.micro_batch_size, data_parallel_size(cfg, world_size)
    gbs = global_batch_size(cfg, world_size)
    if gbs % (micro * dp):
        raise ConfigError(
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size "
            f"({micro}) x data-parallel size ({dp}) = {micro * dp}"
        )
    if t.step_batch_size_schedule is not None and t.global_batch_size is not None:
        final = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)[-1][1]
        if final != t.global_batch_size:
            raise ConfigError(
                f"--global-batch-size ({t.global_batch_size}) differs from the last batch size of "
                f"--step-batch-size-schedule ({final}); give one of them, or the same size"
            )


def _check_length(cfg: Config, world_size: int) -> None:
    """The LR warm-up ends before its decay does (a run without a length is refused when it
    starts to train: ``training.pretrain``; the planner needs none)."""
    if cfg.logging.eval_only or not train_iters(cfg, world_size):
        return
    warmup, decay = lr_lengths(cfg, world_size)
    if not warmup < decay:
        raise ConfigError(
            f"the LR warm-up ({warmup:g} samples) must end before the decay length ({decay} samples: "
            "--lr-decay-iters/--lr-decay-samples, default the run's length)"
        )


def _check_inputs(cfg: Config) -> None:
    """There is data to train on, and a vocabulary size to build the embedding with."""
    d = cfg.data
    if cfg.logging.eval_only and not cfg.logging.eval_iters:
        raise ConfigError("--eval-only evaluates --eval-iters batches: 0 evaluates nothing")
    if not d.mock_data and not d.has_files and not cfg.logging.eval_only:
        raise ConfigError(
            "no training data: pass --data-path PREFIX (from tools/preprocess_data.py), per-split "
            "paths (--train-data-path ...) or --mock-data"
        )
    if d.mock_data and cfg.model.vocab_size is None and d.tokenizer_type is None:
        raise ConfigError("--mock-data needs --vocab-size (or a --tokenizer-type to take it from)")


def _check_outputs(cfg: Config) -> None:
    """Whatever asks for a save has a directory to save to."""
    c, t = cfg.checkpoint, cfg.train
    if c.save_interval is not None and not c.save and not cfg.logging.eval_only:
        raise ConfigError("--save-interval needs --save DIR")
    if (t.exit_interval or t.exit_signal_handler) and not c.save:
        raise ConfigError("--exit-interval / --exit-signal-handler need --save DIR to save to")


def _check_paths(cfg: Config) -> None:
    """A path that exists as the wrong kind fails here, before anything opens it: a FIFO as
    --log-file would block the first log line forever, a file as --save fails deep in a save."""
    c, g, d = cfg.checkpoint, cfg.logging, cfg.data
    for flag, path, directory in (
        ("--save", c.save, True),
        ("--tensorboard-dir", g.tensorboard_dir, True),
        ("--data-cache-path", d.data_cache_path, True),
        ("--log-file", g.log_file, False),
    ):
        if not path:
            continue
        if os.path.exists(path) and (not os.path.isdir(path) if directory else not os.path.isfile(path)):
            kind = "a directory" if directory else "a regular file"
            raise ConfigError(f"{flag} {path} exists and is not {kind}")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ConfigError(f"{flag} {path}: {parent} is not a directory")
