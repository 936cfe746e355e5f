"""A MoE transformer layer cut at its expert all-to-alls into the nodes the overlapped schedule
runs (megatron-core keeps the same split beside its model, ``fine_grained_callables.py``):

    pre (attention, router, permute) | dispatch a2a | experts | combine a2a | post (unpermute, residual)
                                       shared experts (while the dispatch is in flight)

The layer's ordinary forward (``model.block.TransformerLayer.forward``) is these nodes in this
order with blocking, differentiable all-to-alls between them (``MoELayer.expert_rows``): one
autograd graph. ``--overlap-moe-expert-parallel-comm`` (``pipeline/a2a_overlap.py``) runs the
same nodes, each its own graph, with the all-to-alls in flight while another micro-batch
computes: what a node computes is decided by the layer, when it runs by the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.moe.dispatcher import Exchange
from megatron_p2r.moe.layer import Routed
from megatron_p2r.parallel import random as tp_random


@dataclasses.dataclass(frozen=True)
class LayerNodes:
    """One MoE layer's nodes and what its all-to-alls need. ``recomputed``: each node keeps only
    its inputs and recomputes its activations in its backward (``recompute``)."""

    pre: Callable[..., Tuple[torch.Tensor, Routed]]  # (x, rope) -> (residual stream, routing)
    experts: Callable[[torch.Tensor, Exchange], torch.Tensor]  # (received rows, exchange) -> rows to send back
    post: Callable[..., torch.Tensor]  # (combined rows, residual, combine weights, routing) -> the layer's output
    exchange: Callable[[Routed], Exchange]  # the splits of both all-to-alls (a small all-to-all of counts)
    group: Optional[dist.ProcessGroup]  # the all-to-alls' (the EP group)
    shared: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # the shared experts, on the layer's input
    recomputed: bool = False

    def recompute(self, device: torch.device) -> "LayerNodes":
        """The nodes each under the model's recomputation (``parallel.random.checkpoint``: both
        RNG streams replay): the serial recomputation of the layer cut at its all-to-alls. What
        the cut needs is kept instead: the nodes' inputs, the all-to-alls' results among them,
        so a backward re-communicates nothing (the serial recomputation runs them again)."""

        def recomputed(node: Callable) -> Callable:
            return functools.partial(tp_random.checkpoint, node, device=device)

        return dataclasses.replace(
            self,
            pre=recomputed(self.pre),
            experts=recomputed(self.experts),
            post=recomputed(self.post),
            shared=None if self.shared is None else recomputed(self.shared),
            recomputed=True,
        )
