"""Shared parts of the equivalence tests: a tiny config and the single-process reference."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_p2r.arguments import config_from_values
from megatron_p2r.config import Config
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.sharding import logical_name, tp_slice
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining

# Explicit where Megatron-LM's defaults (which are ours) would change what the tests were written for:
# no dropout, top-1 routing on the softmax probabilities, AdamW beta2 0.95, fp16's scale 2^16 halved on
# each overflow, a log line and a short evaluation per step.
TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=200,
    make_vocab_size_divisible_by=16,
    micro_batch_size=2,
    mock_data=True,
    lr=1e-2,
    lr_decay_style="constant",
    weight_decay=0.0,
    clip_grad=0.0,
    seed=7,
    train_iters=10,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    moe_router_topk=1,
    moe_router_pre_softmax=True,
    adam_beta2=0.95,
    initial_loss_scale=2.0**16,
    hysteresis=1,
    log_interval=1,
    eval_iters=2,
)


def tiny_config(**overrides) -> Config:
    return config_from_values({**TINY, **overrides})


def reference_config(cfg: Config) -> Config:
    """The same model on one process (no TP/PP/EP/CP, no interleaving; same global batch)."""
    return cfg.replace(
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        pipeline_layer_split=None,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None,
    )


def random_microbatches(cfg: Config, n: int, batch: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_length + 1), generator=g)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(batch, cfg.model.seq_length)})
    return out


def reference_grads(cfg: Config, microbatches: list):
    """Loss and {logical name: full gradient} of the one-process model on ``microbatches``."""
    model = build_model(reference_config(cfg), ParallelState.single())
    loss = forward_backward_no_pipelining(model, microbatches, ParallelState.single())
    return loss.item(), {logical_name(n, p): p.grad.clone() for n, p in model.named_parameters()}


def expected_shard(full: torch.Tensor, param, ps: ParallelState) -> torch.Tensor:
    """This rank's slice of a reference tensor, per the parameter's sharding attributes."""
    if getattr(param, "expert", False):
        n = param.shape[0]
        full = full[ps.ep_rank * n : (ps.ep_rank + 1) * n]
    return tp_slice(full, getattr(param, "tp_dim", None), ps.tp_rank, ps.tp_size, getattr(param, "tp_replicas", 1))


def max_grad_error(model, ps: ParallelState, ref: dict, relative: bool = False) -> dict:
    """{name: max |gradient - reference shard|} for every parameter of ``model``; with
    ``relative``, divided by the shard's largest reference magnitude. The gradient is the
    reduced ``main_grad`` of a model with gradient buffers (built as training builds it), else
    ``.grad``."""
    out = {}
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", p.grad)
        want = expected_shard(ref[logical_name(name, p)], p, ps).float()
        assert want.shape == grad.shape, f"{name}: shard {tuple(grad.shape)} vs reference {tuple(want.shape)}"
        err = (grad - want).abs().max().item()
        out[name] = err / max(want.abs().max().item(), 1e-30) if relative else err
    return out


def run_steps(
    cfg: Config,
    ps: ParallelState,
    steps: int,
    *,
    load: Optional[str] = None,
    after_step: Optional[Callable] = None,
    outputs: Optional[list] = None,
):
    """Train ``steps`` optimizer steps on mock data, from scratch or from the checkpoint ``load``
    (continuing its data); ``after_step(state)`` runs after each, ``outputs`` receives each
    step's ``train_step`` record (its ``grad_norm``...). Returns (losses, state)."""
    from megatron_p2r.checkpoint.io import load_checkpoint
    from megatron_p2r.config import num_microbatches
    from megatron_p2r.training import build_datasets, build_train_state, microbatch_iterator, train_step

    state = build_train_state(cfg, ps)
    if load is not None:
        load_checkpoint(load, state)
    train_ds, _ = build_datasets(cfg, ps)
    data = microbatch_iterator(train_ds, state.consumed_samples, cfg, ps)
    n = num_microbatches(cfg, ps.layout.world_size)
    losses = []
    for _ in range(steps):
        out = train_step(state, [next(data) for _ in range(n)])
        losses.append(out["lm_loss"])
        if outputs is not None:
            outputs.append(out)
        if after_step is not None:
            after_step(state)
    return losses, state


def keep_first_step_grads(into: dict) -> Callable:
    """An ``after_step`` callback that keeps the gradients of the first step: the reduced
    ``main_grad`` the optimizer stepped on (unscaled and clipped), by parameter name."""

    def keep(state) -> None:
        if not into:
            into.update({n: p.main_grad.clone() for n, p in state.model.named_parameters()})

    return keep


def bad_input_error(main, argv, capsys) -> str:
    """The one ``error:`` line an entry point prints for a bad input, after checking it exits 2."""
    assert main([str(a) for a in argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]
