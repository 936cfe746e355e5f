"""A run's start: the device, the process group torchrun started, the validated config and its
ParallelPlan, the process groups and the seeds."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Tuple

import torch
import torch.distributed as dist

from megatron_p2r.config import Config, ConfigError, validate
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.lifecycle import check_run_fits
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState, initialize_plan


def resolve_device(cfg: Config) -> torch.device:
    kind = cfg.parallel.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the job torchrun started (or a one-rank job when run directly)."""
    if dist.is_initialized():
        return
    backend = cfg.parallel.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if "RANK" in os.environ:
        # Under torchrun --max-restarts the restarted workers share the launcher's store with the
        # dead ones, whose keys (gloo/NCCL peer addresses) are still in it: without a prefix per
        # attempt the new ranks connect to dead processes ("Connection refused" at init, torch 2.13).
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"p2r_attempt_{attempt}/", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
        )


def setup_parallel(cfg: Config, device: torch.device) -> Tuple[ParallelState, ParallelPlan]:
    world = dist.get_world_size()
    validate(cfg, world)
    plan = ParallelPlan.for_world(cfg, world)
    check_run_fits(cfg, plan, device)
    ps = initialize_plan(plan, device, timeout=datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, device, ps.cp_rank)
    return ps, plan


def resolve_vocab(cfg: Config) -> Config:
    """The config with the tokenizer's vocabulary size, when one is configured: resolved before
    ``validate`` so the checked config is the one every module reads."""
    if cfg.data.tokenizer_type is None:
        return cfg
    from megatron_p2r.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)  # NullTokenizer's size
    return cfg.replace(vocab_size=tokenizer.vocab_size)
