"""What each spawned rank runs for the distributed-optimizer tests: one spawn per world size
(2 and 4 ranks), many cases per spawn. Every case returns plain numbers (losses, errors, hashes);
``test_distributed_optimizer.py`` asserts on them. No pytest import here: ranks start faster."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from megatron_p2r import reliability
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.config import num_microbatches
from megatron_p2r.parallel import grad_buffer
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import (
    build_datasets,
    build_train_state,
    evaluate,
    microbatch_iterator,
    setup_parallel,
    train_step,
)
from tests.helpers import run_steps
from tests.optim.common import cfg, one_process, weight_error


def _train(c, ps: ParallelState, steps: int):
    """``steps`` train_step calls on mock data: the losses, the gradient norms and the state."""
    state = build_train_state(c, ps)
    data = microbatch_iterator(build_datasets(c, ps)[0], 0, c, ps)
    outs = [
        train_step(state, [next(data) for _ in range(num_microbatches(c, ps.layout.world_size))]) for _ in range(steps)
    ]
    return [o["lm_loss"] for o in outs], [o["grad_norm"] for o in outs], state


def equivalence_cases(rank: int, world: int, cases: dict) -> dict:
    """Per case: 3 steps on this layout and on one process from the same initial model and data,
    gradients clipped to 0.5 (the tiny model's norm is ~1, so every step clips and a wrong norm
    over the shards changes the update): both loss curves, both gradient norms and this rank's
    largest weight error."""
    out = {}
    for label, flags in cases.items():
        c = cfg(clip_grad=0.5, **flags)
        ps, _ = setup_parallel(c, torch.device("cpu"))
        losses, norms, state = _train(c, ps, 3)
        ref_losses, ref_norms, ref = _train(one_process(c), ParallelState.single(), 3)
        out[label] = {
            "losses": losses,
            "ref": ref_losses,
            "norms": norms,
            "ref_norms": ref_norms,
            "weight_err": weight_error(state, ref, ps),
            "sharded": any(b.layout.sharded for b in state.ddp.buffers),
        }
    return out


def staged_collectives(staging_numel: int = 7) -> dict:
    """The staged all-reduce / reduce-scatter / all-gather (through a tiny staging buffer, many
    chunks) against the plain collectives, on data of 2 x 40 elements."""
    r, members = dist.get_rank(), dist.get_world_size()
    data = torch.arange(members * 40, dtype=torch.float32) * (r + 1) + r
    staging = torch.full((staging_numel,), float("nan"))
    reduced, want = data.clone(), data.clone()
    grad_buffer.staged_all_reduce(reduced, staging, None)
    dist.all_reduce(want)
    shard, want_shard = torch.empty(40), torch.empty(40)
    grad_buffer.staged_reduce_scatter(data.clone(), shard, members, staging, None)
    dist.reduce_scatter_tensor(want_shard, data.clone())
    gathered = data.clone()
    gathered.view(members, -1)[1 - r] = -1.0  # the other member's shard, to be filled in
    grad_buffer.staged_all_gather(gathered, r, members, staging, None)
    want_gather = torch.empty_like(data)
    dist.all_gather_into_tensor(want_gather, data.view(members, -1)[r].clone())
    return {
        "all_reduce": torch.equal(reduced, want),
        "reduce_scatter": torch.equal(shard, want_shard),
        "all_gather": torch.equal(gathered, want_gather),
    }


def _hash(state) -> str:
    state.ddp.finish_param_sync()
    h = hashlib.sha256()
    for _, p in sorted(state.model.named_parameters()):
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def checkpoints(rank: int, world: int, root: str, flags: dict, pseudo: dict) -> dict:
    """DP2 with the distributed optimizer: (a) 4 uninterrupted steps, saving after 2; (b) resume
    that checkpoint here and run 2 steps; (c) resume the one-process checkpoint ``root/dp1`` (saved
    without the distributed optimizer) and run 2 steps; (d) a pseudo-phase run saved after 2
    steps, with its eval loss, for delinking."""
    c, saved = cfg(**flags), os.path.join(root, "dp2")
    ps, _ = setup_parallel(c, torch.device("cpu"))

    def save_after_2(s) -> None:
        if s.iteration == 2:
            save_checkpoint(saved, s)

    whole, state = run_steps(c, ps, 4, after_step=save_after_2)
    resumed, again = run_steps(c, ps, 2, load=saved)
    from_dp1, _ = run_steps(c, ps, 2, load=os.path.join(root, "dp1"))
    p = cfg(**pseudo)
    _, pstate = run_steps(p, ps, 2)
    save_checkpoint(os.path.join(root, "pseudo"), pstate)
    _, valid = build_datasets(p, ps)
    return {
        "whole": whole,
        "resumed": resumed,
        "from_dp1": from_dp1,
        "whole_hash": _hash(state),
        "resumed_hash": _hash(again),
        "pseudo_eval": evaluate(pstate, valid),
        "sharded": all(b.layout.sharded for b in state.ddp.buffers),
    }


def non_finite_skip(flags: dict) -> dict:
    """fp16 with the distributed optimizer, a NaN in rank 1's reduced gradient shard only (the
    ``nan_grad`` fault, after the reduction): whether this rank skipped, its loss scale after
    the step, and whether its weights stayed the same."""
    c = cfg(fp16=True, initial_loss_scale=1024.0, **flags)
    ps, _ = setup_parallel(c, torch.device("cpu"))
    state = build_train_state(c, ps)
    before = _hash(state)
    data = microbatch_iterator(build_datasets(c, ps)[0], 0, c, ps)
    os.environ[reliability.FAULT_ENV] = "nan_grad:1@rank1"
    try:
        out = train_step(state, [next(data) for _ in range(num_microbatches(c, ps.layout.world_size))])
    finally:
        del os.environ[reliability.FAULT_ENV]
    return {"skipped": out["skipped"], "scale": state.scaler.scale, "unchanged": _hash(state) == before}


def lean_resume(root: str, flags: dict) -> dict:
    """Per lean optimizer, DP2 with the distributed optimizer: 4 uninterrupted steps saving after
    2 into ``root/<optimizer>``, and the 2 steps resumed from that checkpoint (losses and hashes);
    Adafactor's 2 steps from the one-process AdamW checkpoint ``root/dp1`` (statistics made of
    its second moment)."""
    out = {}
    for optimizer in ("lion", "adafactor"):
        c, saved = cfg(optimizer=optimizer, **flags), os.path.join(root, optimizer)
        ps, _ = setup_parallel(c, torch.device("cpu"))

        def save_after_2(s, saved=saved) -> None:
            if s.iteration == 2:
                save_checkpoint(saved, s)

        whole, state = run_steps(c, ps, 4, after_step=save_after_2)
        resumed, again = run_steps(c, ps, 2, load=saved)
        out[optimizer] = {"whole": whole, "resumed": resumed, "whole_hash": _hash(state), "resumed_hash": _hash(again)}
    out["adafactor"]["from_adam"] = run_steps(
        cfg(optimizer="adafactor", **flags), ps, 2, load=os.path.join(root, "dp1")
    )[0]
    return out


def two_ranks(rank: int, world: int, cases: dict, root: str, flags: dict, pseudo: dict) -> dict:
    return {
        "cases": equivalence_cases(rank, world, cases),
        "staged": staged_collectives(),
        "checkpoints": checkpoints(rank, world, root, flags, pseudo),
        "skip": non_finite_skip(flags),
        "lean": lean_resume(root, flags),
    }
