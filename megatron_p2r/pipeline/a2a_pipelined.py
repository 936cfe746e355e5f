"""The schedule of ``--overlap-moe-expert-parallel-comm``, on one stage and under pipeline
parallelism, interleaved or not: combined 1F1B (Megatron-LM's
``combined_1f1b_schedule_for_interleaved_pipelining``).

Each rank runs its steps of ``order.combined_steps``: a step receives the activation of its
forward and the gradient of its backward (each of one micro-batch on one model chunk, sent by
the neighbours in their previous step), runs the two passes taking turns at their expert
all-to-alls (``a2a_overlap``'s nodes and ``take_turns``), then sends the forward's output and
the backward's input gradient. The warm-up of 2(P-p-1) + (v-1)G + 1 chunk forwards is what
makes every input come from the previous step, so neighbouring stages run their steps side by
side instead of waiting for each other's.

The p2p link (``p2p.StageLink``) is told the step's order as ops (``order.combined_ops``: a
step's backward, then its forward), so every rank receives in its senders' order, and a
step's sends go after both its receives: deadlock-free since what a step receives was sent
by an earlier step (``order.simulate_combined`` walks the steps so and raises on a deadlock;
``tests/pipeline/test_combined_order.py``). A sent output's data is freed as
in 1F1B (``p2p.deallocate_output``); its backward gets the incoming gradient as a stand-in
for it (autograd checks the shapes; the output's values are not read in backward, which
1F1B's ``backward_from`` relies on too).

The math is the serial 1F1B schedule's: on every stage the forwards run in micro-batch order
(the random draws too), the backwards run one after the other in micro-batch order (every
gradient accumulates in the serial order), and each node computes what the one graph of the
serial stage computes. So losses, gradients and weights are bitwise the serial 1F1B schedule's,
interleaved or not (``tests/moe/test_a2a_pipelined.py``).
With P = 1 the order is F(0), F(i+1) with B(i), B(m-1), bitwise ``forward_backward_no_pipelining``
(``tests/moe/test_a2a_overlap.py``).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch

from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.model.nodes import SharedWeights
from megatron_p2r.pipeline.a2a_overlap import MicroBatch, run_pass, take_turns
from megatron_p2r.pipeline.order import (
    BACKWARD,
    FORWARD,
    Op,
    Step,
    combined_ops,
    combined_steps,
    input_of,
    sent_by,
    step_ops,
)
from megatron_p2r.pipeline.p2p import StageLink, deallocate_output
from megatron_p2r.pipeline.token_loss import BackwardScaleHook, TokenMeanLoss, announce_backward_scale
from megatron_p2r.pipeline.transfers import Transfers, transfers


@functools.lru_cache(maxsize=8)
def _rank_link(pp: int, chunks: int, microbatches: int, rank: int) -> Transfers:
    """What ``rank``'s link knows of the step (every step of a run has the same)."""
    return transfers([combined_ops(pp, chunks, microbatches, r) for r in range(pp)], pp, chunks, rank)


class _CombinedStage:
    """This rank's steps: the micro-batches awaiting their backward, the link to the neighbours."""

    def __init__(
        self,
        model,
        microbatches: List[dict],
        ps: ParallelState,
        link: StageLink,
        loss: Optional[TokenMeanLoss],
        chunks: int,
    ):
        self.model, self.microbatches, self.ps, self.link, self.loss = model, microbatches, ps, link, loss
        self.chunks, self.shared = chunks, SharedWeights(model)
        self.held: Dict[Tuple[int, int], MicroBatch] = {}  # (micro-batch, chunk) -> awaiting its backward

    def run(self, step: Step) -> None:
        """Receive the step's inputs, run its passes taking turns (the forward first), send what
        they made; receives and sends in ``order.step_ops``'s order, as the link expects."""
        ops = step_ops(step)
        received = {op.kind: self._input(op) for op in ops}
        forward, backward = step
        passes = []
        if forward is not None:
            current = MicroBatch(
                self.model,
                self.microbatches[forward.microbatch],
                self.loss,
                self.shared,
                received=received[FORWARD],
                chunk=forward.chunk,
            )
            self.held[forward.microbatch, forward.chunk] = current
            passes.append(current.forward())
        if backward is not None:
            grad, done = received[BACKWARD], self.held.pop((backward.microbatch, backward.chunk))
            if grad is not None:
                done.output.data = grad  # a stand-in for the freed output's data: only its shape is checked
            passes.append(done.backward(grad))
        if len(passes) == 2:
            take_turns(*passes)
        else:
            run_pass(passes[0])
        for op in ops:
            made = current.output if op.kind == FORWARD else done.input_grad
            for dst, message in sent_by(op, self.ps.pp_size, self.chunks, self.ps.pp_rank):
                self.link.send(message, made, dst)
                if op.kind == FORWARD:
                    deallocate_output(made)

    def _input(self, op: Op) -> Optional[torch.Tensor]:
        wanted = input_of(op, self.ps.pp_size, self.chunks, self.ps.pp_rank)
        return None if wanted is None else self.link.recv(*wanted)


def forward_backward_combined_1f1b(
    model,
    microbatches: List[dict],
    ps: ParallelState,
    *,
    loss_scale: float = 1.0,
    on_backward_scale: BackwardScaleHook = None,
) -> Optional[torch.Tensor]:
    """A training step's micro-batches through this rank's stage in the combined 1F1B order
    (training only: evaluation has no backward to overlap with); returns on the last stage
    this DP rank's share of the token mean, None elsewhere (as the serial schedules)."""
    n, chunks = len(microbatches), model.num_model_chunks
    if n == 0:
        raise ValueError("a step needs at least one micro-batch")
    announce_backward_scale(on_backward_scale, loss_scale, n, False)
    specs = [model.hidden_spec(tuple(mb["tokens"].shape)) for mb in microbatches]
    link = StageLink(ps, _rank_link(ps.pp_size, chunks, n, ps.pp_rank), lambda msg: specs[msg.microbatch])
    loss = TokenMeanLoss(microbatches, ps, loss_scale) if ps.is_last_stage else None
    stage = _CombinedStage(model, microbatches, ps, link, loss, chunks)
    for step in combined_steps(ps.pp_size, chunks, n, ps.pp_rank):
        stage.run(step)
    link.wait()
    return None if loss is None else loss.share()
