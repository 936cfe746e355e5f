"""Helpers shared by the pipeline tests (importable by spawned ranks).

The pattern (see ``tests/helpers.py``): inside a rank, run a pipelined step and the
single-process reference (same seed -- initialisation is layout-invariant) on the same
micro-batches, and measure how far this rank's loss and gradient shards are from it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Callable, List, Optional, Sequence

import torch

from megatron_p2r.model.m6 import build_model
from megatron_p2r.moe import aux_loss
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import Layout, ParallelState, initialize
from megatron_p2r.config.schedule import GPIPE, INTERLEAVED, NO_PIPELINING, ONE_F_ONE_B, SchedulePlan
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron_p2r.training import build_train_state, reduce_loss
from tests.helpers import max_grad_error, reference_config, tiny_config

# (batch, sequence) of successive micro-batches: sizes differ on purpose (each stage allocates
# what it receives from the micro-batch's shape).
SHAPES = [(2, 16), (1, 12), (3, 16)]


def make_cfg(tp: int = 1, pp: int = 1, **overrides):
    """A tiny pipeline config whose transfers are serial unless a case asks for
    --overlap-p2p-communication (on by default): the overlapped cases are compared with these."""
    return tiny_config(
        **{
            "num_layers": 4,
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "overlap_p2p_communication": False,
            **overrides,
        }
    )


# Fraction of valid tokens of successive micro-batches in the token-weighting cases: far
# apart, so a mean of per-micro-batch means differs clearly from the global token mean.
UNEVEN_KEEP = (0.05, 0.9, 0.5, 1.0, 0.3, 0.7, 0.15, 0.6)


def make_microbatches(n: int, vocab: int, seed: int = 0, keep: Sequence[float] = (0.8,)) -> List[dict]:
    """``n`` micro-batches of the shapes in SHAPES; micro-batch i keeps about keep[i % len]
    of its tokens in the loss (masked tokens must not count)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, s = SHAPES[i % len(SHAPES)]
        tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
        mask = (torch.rand(b, s, generator=g) > 1 - keep[i % len(keep)]).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def make_state(layout: Layout) -> ParallelState:
    """Groups for ``layout`` (collective: every rank calls it, in the same order): the cross-stage
    groups of the tied embedding and of a pseudo slot on every stage, and those of gradients
    partial over the whole TP group (sequence parallelism's norms and biases)."""
    tp_blocks = (((), layout.tp),) if layout.tp > 1 else ()
    return initialize(
        layout, torch.device("cpu"), stage_sets=((0, layout.pp - 1), tuple(range(layout.pp))), tp_blocks=tp_blocks
    )


def reference(cfg, microbatches: List[dict]):
    """Loss and {logical name: gradient} of the one-process model, a plain module in the
    weights' dtype of ``cfg``: each micro-batch's gradient summed in fp32 by a hook of its own
    (no gradient buffer), as training sums 16-bit gradients."""
    single = ParallelState.single()
    model = build_model(reference_config(cfg), single)
    sums = {}

    def accumulate(name: str, p) -> None:
        sums[name] = p.grad.float() if name not in sums else sums[name] + p.grad.float()
        p.grad = None

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(functools.partial(accumulate, logical_name(name, p)))
    loss = forward_backward_no_pipelining(model, microbatches, single, on_backward_scale=aux_loss.set_backward_scale)
    return loss.item(), sums


def token_mean_reference(cfg, microbatches: List[dict], *, forward_only: bool = False):
    """Loss and {logical name: gradient} of sum(token loss x mask) / sum(mask) over all the
    micro-batches, written out on the one-process model without the schedules: the
    definition every layout must reproduce. (No MoE: router losses follow the schedules'
    per-micro-batch averaging, checked against ``reference``.)"""
    model = build_model(reference_config(cfg), ParallelState.single())
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        sums = [(model(tokens=mb["tokens"], labels=mb["labels"]) * mb["loss_mask"]).sum() for mb in microbatches]
        loss = torch.stack(sums).sum() / sum(mb["loss_mask"].sum() for mb in microbatches)
    if not forward_only:
        loss.backward()
    return loss.item(), {logical_name(n, p): p.grad for n, p in model.named_parameters()}


def schedule_of(schedule: str, pp: int, chunks: int, posts_receives_ahead: bool) -> SchedulePlan:
    """The plan of --pipeline-schedule ``schedule`` over ``pp`` stages of ``chunks`` chunks, its
    receives posted ahead whether interleaved or not (the config allows it under interleaving
    only, but the pipelined schedules run it under any order: the tests check all of them)."""
    if pp == 1:
        return SchedulePlan(NO_PIPELINING, 1, 1)
    kind = GPIPE if schedule == "gpipe" else INTERLEAVED if chunks > 1 else ONE_F_ONE_B
    return SchedulePlan(kind, pp, chunks, posts_receives_ahead=posts_receives_ahead)


def pipelined_step(cfg, ps: ParallelState, microbatches: List[dict], schedule: str, stats: Optional[dict] = None):
    """One forward/backward on this rank's stage, built and reduced as training does it
    (``build_train_state``: the model, its gradient buffers and optimizer; the DDP's reduction
    after the schedule); (model, DP-mean loss). The reduced gradients are the parameters'
    ``main_grad``, what the optimizer steps on."""
    state = build_train_state(cfg, ps)
    state.ddp.zero_grad_buffer(len(microbatches))
    fb = get_forward_backward_func(
        schedule_of(schedule, ps.pp_size, state.plan.num_model_chunks, cfg.parallel.overlap_p2p_communication)
    )
    loss = fb(state.model, microbatches, ps, loss_scale=1.0, stats=stats, on_backward_scale=aux_loss.set_backward_scale)
    if ps.is_last_stage and loss is None:
        raise AssertionError("the last stage must return the loss")
    state.ddp.finish_grad_sync()
    return state.model, reduce_loss(loss, ps)


def compare_case(
    cfg,
    layout: Layout,
    ps: ParallelState,
    schedule: str,
    n_micro: int,
    data_seed: int = 0,
    keep: Sequence[float] = (0.8,),
    reference_fn: Callable = reference,
) -> dict:
    """One pipelined step (``n_micro`` micro-batches per DP rank) against ``reference_fn`` on
    all DP ranks' micro-batches: loss error, max gradient error (absolute, and relative to the
    largest reference element of each tensor), logical names compared, gradient hashes."""
    all_mb = make_microbatches(n_micro * layout.dp, cfg.model.vocab_size, data_seed, keep)
    mine = all_mb[ps.dp_rank * n_micro : (ps.dp_rank + 1) * n_micro]
    model, loss = pipelined_step(cfg, ps, mine, schedule)
    ref_loss, ref_grads = reference_fn(cfg, all_mb)
    errors = max_grad_error(model, ps, ref_grads)
    relative = max_grad_error(model, ps, ref_grads, relative=True)
    return {
        "loss": loss,
        "loss_err": abs(loss - ref_loss),
        "grad_err": max(errors.values()),
        "grad_rel_err": max(relative.values()),
        "names": sorted(logical_name(n, p) for n, p in model.named_parameters()),
        "ref_names": sorted(ref_grads),
        "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
        "hashes": gradient_hashes(model, ps),
    }


def gradient_hashes(model, ps: ParallelState) -> dict:
    """{logical name @ tp rank, ep rank: sha256 of this rank's gradient}: merged over ranks, two
    layouts of one model can be compared bitwise whichever ranks hold which layers."""
    return {
        f"{logical_name(n, p)}@{ps.tp_rank},{ps.ep_rank}": hashlib.sha256(p.main_grad.numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
    }
