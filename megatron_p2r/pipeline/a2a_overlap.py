"""``--overlap-moe-expert-parallel-comm``: the expert all-to-alls of one micro-batch in flight
while another micro-batch computes (Megatron-LM's batch-level EP overlap; DeepSeek-V3's
DualPipe overlaps the same way).

On one stage the forward of micro-batch i+1 runs together with the backward of micro-batch i
(``a2a_pipelined.forward_backward_combined_1f1b`` with P = 1). Each micro-batch's pass runs
the stage node by node, one autograd graph each, so that the two passes can take turns: a MoE
layer's nodes are the model's (``M6Model.layer_nodes``, ``moe/nodes.py``: pre | dispatch a2a |
experts | combine a2a | post, the nodes its ordinary forward runs in one graph), and every other
piece of the stage (embedding, dense layer, output layer + loss) is one node. This module only
decides when each node runs and keeps each micro-batch's books. A node's inputs are fresh
leaves detached from the previous node's outputs (``model.nodes.leaf``); its backward is
``torch.autograd.backward(outputs, grads)``, which leaves the gradients of its inputs on those
leaves for the node before it. An all-to-all is started asynchronously (``start_all_to_all``)
and waited on just before its result is needed (a layer's shared experts are a node of their own,
run once its dispatch is started; their backward once the combine's reverse is); after starting one, a pass hands the turn to the
other (each pass is a generator that yields there).

The math is that of the serial schedule: the nodes compute what the one graph computes (an
all-to-all moves rows, it adds nothing), only backward passes touch gradients and they run one
micro-batch after the other, and only forward passes draw random numbers, in micro-batch order.
So losses, gradients and updated weights are bitwise those of ``forward_backward_no_pipelining``
(of the 1F1B schedule under pipeline parallelism).
The schedule's structure, not timing, decides every turn, so all ranks issue their collectives
in the same order. Each micro-batch's backward still starts at the model's output (the
data-parallel hooks see it: ``parallel/ddp.py``).

Weights read by several nodes (tied embeddings, Pseudo-to-Real's shared layers) get their
gradient summed over the nodes before it is accumulated, as one graph would
(``model.nodes.SharedWeights``).
Like Megatron-LM this needs EP > 1 (``config/validation.py`` checks it). The schedule that pairs
the passes, on one stage or under pipeline parallelism, is ``a2a_pipelined.py``'s combined 1F1B.

Full recomputation (``--recompute-granularity full`` with one layer per recomputed unit: uniform
1, or block) is recomputation per node, as the model's nodes of a recomputed layer do it
(``LayerNodes.recompute``: the serial recomputation of that layer cut at its all-to-alls, which
keeps the all-to-alls' results). The rows a node sent are freed once received: under
recomputation nothing in its graph holds them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, List, Optional

import torch

from megatron_p2r.model.nodes import SharedWeights, leaf, node_backward
from megatron_p2r.moe.layer import Routed
from megatron_p2r.parallel.mappings import start_all_to_all
from megatron_p2r.pipeline.token_loss import TokenMeanLoss

# A pass is a generator: it yields each time it has started an all-to-all, to let the other compute.
Pass = Iterator[None]


class _Exchanged:
    """One all-to-all of rows: started in forward, its reverse in backward."""

    def __init__(self, rows: torch.Tensor, out_splits: List[int], in_splits: List[int], group):
        self.splits, self.group = (out_splits, in_splits), group
        self.received, self._wait = start_all_to_all(rows.detach(), out_splits, in_splits, group)

    def result(self) -> torch.Tensor:
        """The received rows, as a leaf whose gradient ``start_reverse`` sends back."""
        self._wait()
        self._wait = None  # it references the sent rows: they may be freed now
        self.received = leaf(self.received)
        return self.received

    def start_reverse(self) -> None:
        out_splits, in_splits = self.splits
        self.grad, self._wait = start_all_to_all(self.received.grad, in_splits, out_splits, self.group)

    def grad_of_sent(self) -> torch.Tensor:
        self._wait()
        return self.grad


def _release(rows: torch.Tensor) -> None:
    """Free the storage of all-to-all rows no graph saved: the rows a node sent, once received
    (its backward reads only their shape); without recomputation also the rows a node received,
    once it has read them (its backward reads only their gradient). The cut layer then holds what
    the serial layer holds, which frees each of these once the next op has read it."""
    rows.untyped_storage().resize_(0)


class MicroBatch:
    """One micro-batch's pass through the stage, node by node: ``forward()`` and then
    ``backward()`` are passes for the overlapped schedule. Under pipeline parallelism
    (``a2a_pipelined.py``) a stage after the first starts from ``received``, the previous
    stage's activation, and leaves its gradient in ``input_grad``; a stage before the last ends
    at ``output``, and its backward starts from the next stage's gradient of it."""

    def __init__(
        self,
        model,
        mb: dict,
        loss: Optional[TokenMeanLoss],
        shared: SharedWeights,
        received: Optional[torch.Tensor] = None,
        chunk: int = 0,
    ):
        self.model, self.mb, self.loss, self.shared, self.received = model, mb, loss, shared, received
        self.chunk = chunk  # the model chunk (virtual stage) it runs, with interleaving
        self.aliases = shared.aliases()
        # per layer, in forward order: its backward (a pass), from the gradient of its output to its input's
        self.tape: List[Callable[[torch.Tensor], Pass]] = []
        self.loss_sum: Optional[torch.Tensor] = None
        self.embedded: Optional[torch.Tensor] = None
        self.hidden: Optional[torch.Tensor] = None
        self.output: Optional[torch.Tensor] = None
        self.input_grad: Optional[torch.Tensor] = None

    def forward(self) -> Pass:
        """The nodes' forward, the shared weights read through this pass's aliases (only while
        this pass computes: the other one may compute in between). A recomputed node's backward
        needs no aliases: its graph is the forward's, the recomputation refills its saved tensors."""
        nodes = self._nodes()
        while True:
            with self.shared.read_through(self.aliases):
                try:
                    next(nodes)
                except StopIteration:
                    return
            yield

    def _nodes(self) -> Pass:
        model, mb = self.model, self.mb
        x, rope = model.chunk_input(self.chunk, mb["tokens"], self.received)
        self.embedded = x if self.received is None else None
        for position in model.layer_positions(self.chunk):
            x = yield from self._layer(position, leaf(x), rope)
        # through the model's forward, so that its hooks see where each backward starts
        if not model.stage.chunks[self.chunk].last:  # its output goes to the next stage
            self.output = model(hidden=x, head_only=True, chunk=self.chunk)
            return
        self.hidden = leaf(x)
        self.loss_sum = self.loss.add(
            model(hidden=self.hidden, labels=mb["labels"], loss_mask=mb["loss_mask"], head_only=True, chunk=self.chunk)
        )

    def backward(self, grad: Optional[torch.Tensor] = None) -> Pass:
        """From the loss, or from ``grad``, the next stage's gradient of ``output``."""
        if grad is None:
            self.loss.backward(self.loss_sum)
            grad = self.hidden.grad
        while self.tape:
            grad = yield from self.tape.pop()(grad)
        if self.embedded is not None:
            node_backward([self.embedded], [grad])
        else:
            self.input_grad = grad
        self.shared.accumulate(self.aliases)

    def _layer(self, position: int, x: torch.Tensor, rope):
        nodes = self.model.layer_nodes(position)
        if nodes is None:  # no all-to-all: one node
            out = self.model.layer_node(position)(x, rope)
            self.tape.append(functools.partial(self._dense_backward, x, out))
            return out
        residual, routed = nodes.pre(x, rope)
        handle = nodes.exchange(routed)
        dispatched = _Exchanged(routed.rows, *handle.dispatch_splits, nodes.group)
        shared = _shared_node(nodes, routed)  # computed while the dispatch is in flight
        if shared is not None:
            routed = dataclasses.replace(routed, shared=shared.output_leaf)
        yield
        received = dispatched.result()
        _release(routed.rows)
        expert_out = nodes.experts(received, handle)
        if not nodes.recomputed:
            _release(received)
        combined = _Exchanged(expert_out, *handle.combine_splits, nodes.group)
        yield
        rows, residual_in, weights = combined.result(), leaf(residual), leaf(routed.weights)
        _release(expert_out)
        out = nodes.post(rows, residual_in, weights, routed)
        if not nodes.recomputed:
            _release(rows)
        self.tape.append(
            functools.partial(
                self._moe_backward,
                _MoENodes(x, residual, routed, dispatched, expert_out, combined, residual_in, weights, out, shared),
            )
        )
        return out

    @staticmethod
    def _dense_backward(x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> Pass:
        node_backward([out], [grad])
        return x.grad
        yield  # a generator that never hands the turn over: no communication here

    @staticmethod
    def _moe_backward(n: "_MoENodes", grad: torch.Tensor) -> Pass:
        node_backward([n.out], [grad])  # post
        n.combined.start_reverse()
        shared_grad = []
        if n.shared is not None:  # while the combine's gradient is in flight
            node_backward([n.shared.output], [n.shared.output_leaf.grad])
            shared_grad = [n.shared.input.grad]
        yield
        node_backward([n.expert_out], [n.combined.grad_of_sent()])  # experts
        n.dispatched.start_reverse()
        yield
        node_backward(
            [n.residual, n.routed.weights, n.routed.rows] + ([n.routed.shared_input] if shared_grad else []),  # pre
            [n.residual_in.grad, n.weights.grad, n.dispatched.grad_of_sent()] + shared_grad,
        )
        return n.x.grad


@dataclasses.dataclass
class _MoENodes:
    """What a MoE layer's backward needs of its forward's nodes."""

    x: torch.Tensor  # the layer's input (leaf)
    residual: torch.Tensor  # pre's outputs: the residual stream after attention,
    routed: "Routed"  # ... the routing (its rows and combine weights)
    dispatched: _Exchanged
    expert_out: torch.Tensor  # the experts' output, in the order it was received
    combined: _Exchanged
    residual_in: torch.Tensor  # post's inputs (leaves)
    weights: torch.Tensor
    out: torch.Tensor  # the layer's output
    shared: Optional["_SharedNode"]  # the shared experts' node, if any


@dataclasses.dataclass
class _SharedNode:
    """The shared experts as a node of their own: the layer's input (a leaf) to their output,
    handed to post as a leaf."""

    input: torch.Tensor
    output: torch.Tensor
    output_leaf: torch.Tensor


def _shared_node(nodes, routed: Routed) -> Optional[_SharedNode]:
    if nodes.shared is None:
        return None
    x = leaf(routed.shared_input)
    out = nodes.shared(x)
    return _SharedNode(x, out, leaf(out))


def take_turns(first: Pass, second: Pass) -> None:
    """Run two passes, each until it starts an all-to-all, then the other, until both are done."""
    passes = [first, second]
    while passes:
        for p in list(passes):
            try:
                next(p)
            except StopIteration:
                passes.remove(p)


def run_pass(one: Pass) -> None:
    for _ in one:
        pass
