"""``--overlap-moe-expert-parallel-comm``: the expert all-to-alls of one micro-batch in flight
while another micro-batch computes (Megatron-LM's batch-level EP overlap; DeepSeek-V3's
DualPipe overlaps the same way).

On one stage the forward of micro-batch i+1 runs together with the backward of micro-batch i
(``a2a_pipelined.forward_backward_combined_1f1b`` with P = 1). Each micro-batch's pass is cut
at its all-to-alls into nodes, one autograd graph each, so that the two passes can take turns:
a MoE layer is

    pre (attention, router, permute) | dispatch a2a | experts | combine a2a | post (unpermute, residual)

and every other piece of the stage (embedding, dense layer, output layer + loss) is one node. A
node's inputs are fresh leaves detached from the previous node's outputs; its backward is
``torch.autograd.backward(outputs, grads)``, which leaves the gradients of its inputs on those
leaves for the node before it. An all-to-all is started asynchronously (``start_all_to_all``)
and waited on just before its result is needed; after starting one, a pass hands the turn to the
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
gradient summed over the nodes before it is accumulated, as one graph would (``SharedWeights``).
Like Megatron-LM this needs EP > 1 (``config/validation.py`` checks it). The schedule that pairs
the passes, on one stage or under pipeline parallelism, is ``a2a_pipelined.py``'s combined 1F1B.

Full recomputation (``--recompute-granularity full`` with one layer per recomputed unit: uniform
1, or block) is recomputation per node: each node of a recomputed layer runs under the model's
own checkpoint (``parallel.random.checkpoint``: both RNG streams replay) and recomputes its
activations in its backward, which is the serial schedule's recomputation of that layer cut at
its all-to-alls. What the cut needs is kept instead of recomputed: the nodes' inputs, among them
the all-to-alls' results, so a backward re-communicates nothing (the serial recomputation runs
the layer's all-to-alls again). The rows a node sent are freed once received: under
recomputation nothing in its graph holds them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Callable, Iterator, List, Optional, Set

import torch
from torch import nn

from megatron_p2r.moe.layer import Routed
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.mappings import start_all_to_all
from megatron_p2r.pipeline.token_loss import TokenMeanLoss

# A pass is a generator: it yields each time it has started an all-to-all, to let the other compute.
Pass = Iterator[None]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _backward(outputs: List[torch.Tensor], grads: List[Optional[torch.Tensor]]) -> None:
    """Back-propagate a node's output gradients (those that reached it) through its graph."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class _Exchanged:
    """One all-to-all of rows: started in forward, its reverse in backward."""

    def __init__(self, rows: torch.Tensor, out_splits: List[int], in_splits: List[int], group):
        self.splits, self.group = (out_splits, in_splits), group
        self.received, self._wait = start_all_to_all(rows.detach(), out_splits, in_splits, group)

    def result(self) -> torch.Tensor:
        """The received rows, as a leaf whose gradient ``start_reverse`` sends back."""
        self._wait()
        self._wait = None   # it references the sent rows: they may be freed now
        self.received = _leaf(self.received)
        return self.received

    def start_reverse(self) -> None:
        out_splits, in_splits = self.splits
        self.grad, self._wait = start_all_to_all(self.received.grad, in_splits, out_splits, self.group)

    def grad_of_sent(self) -> torch.Tensor:
        self._wait()
        return self.grad


class SharedWeights:
    """The weights that several nodes of a pass read: a layer module called by several layers
    (Pseudo-to-Real's sharing), an output layer tied to the embedding. In one graph autograd sums
    a weight's gradient over its uses and accumulates it once; node by node each node's backward
    would accumulate its own part (another rounding, and the data-parallel hooks would see the
    weight final too early). So a pass reads them through aliases (leaves on the same storage),
    whose gradients sum over the nodes in the order autograd sums them, and hands each sum to its
    weight at the end of the pass's backward: one accumulation, bitwise the serial one."""

    def __init__(self, model):
        uses = collections.Counter(id(call) for call in model.layer_calls)
        shared = {id(c): c for c in model.layer_calls if uses[id(c)] > 1 and isinstance(c, nn.Module)}
        self.slots = [(m, name, p) for module in shared.values() for m in module.modules()
                      for name, p in m.named_parameters(recurse=False)]
        if model.embedding is not None and model.final_norm is not None and model.output_layer is None:
            word = model.embedding.word_embeddings   # tied: the output layer reads the embedding's matrix
            self.slots.append((word, "weight", word.weight))

    def aliases(self) -> List[torch.Tensor]:
        return [_leaf(p) for _, _, p in self.slots]

    @contextlib.contextmanager
    def read_through(self, aliases: List[torch.Tensor]):
        for (module, name, _), alias in zip(self.slots, aliases, strict=True):
            module._parameters[name] = alias
        try:
            yield
        finally:
            for module, name, p in self.slots:
                module._parameters[name] = p

    def accumulate(self, aliases: List[torch.Tensor]) -> None:
        _backward([p for _, _, p in self.slots], [a.grad for a in aliases])


def recomputed_layers(model) -> Set[int]:
    """Positions (in ``model.layer_calls``) of the layers recomputed in full. Each is its own
    unit (``config/validation.py`` refuses units of several layers with this schedule), so its
    recomputation can be cut into the layer's nodes."""
    return {p for chunk in model.recompute_units for unit, recomputed in chunk if recomputed for p in unit}


def _call(fn: Callable, *args):
    return fn(*args)


def _node(device: torch.device, fn: Callable, *args):
    """``fn(*args)`` keeping only its inputs: its activations are recomputed in its backward,
    replaying both RNG streams (the model's recomputation: ``M6Model.forward``)."""
    return tp_random.checkpoint(fn, *args, device=device)


def _release(rows: torch.Tensor) -> None:
    """Free the storage of all-to-all rows no graph saved: the rows a node sent, once received
    (its backward reads only their shape); without recomputation also the rows a node received,
    once it has read them (its backward reads only their gradient). The cut layer then holds what
    the serial layer holds, which frees each of these once the next op has read it."""
    rows.untyped_storage().resize_(0)


def _pre(layer, x: torch.Tensor, rope):
    """A MoE layer up to its dispatch: attention, router, permute."""
    residual = layer.attend(x, rope)
    return residual, layer.mlp.route(layer.post_attention_norm(residual))


def _experts(mlp, received: torch.Tensor, handle) -> torch.Tensor:
    """The local experts on the received rows, returned in the order they were received."""
    d = mlp.dispatcher
    return d.unsorted(mlp.experts(d.sorted_by_expert(received, handle), handle.local_counts), handle)


def _post(layer, rows: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor, routed: Routed) -> torch.Tensor:
    """A MoE layer after its combine: unpermute, weight, add to the residual stream."""
    return layer.add_mlp(residual, layer.mlp.finish(rows, weights, routed))


class MicroBatch:
    """One micro-batch's pass through the stage, node by node: ``forward()`` and then
    ``backward()`` are passes for the overlapped schedule. Under pipeline parallelism
    (``a2a_pipelined.py``) a stage after the first starts from ``received``, the previous
    stage's activation, and leaves its gradient in ``input_grad``; a stage before the last ends
    at ``output``, and its backward starts from the next stage's gradient of it."""

    def __init__(self, model, mb: dict, loss: Optional[TokenMeanLoss], shared: SharedWeights,
                 received: Optional[torch.Tensor] = None, chunk: int = 0):
        self.model, self.mb, self.loss, self.shared, self.received = model, mb, loss, shared, received
        self.chunk = chunk   # the model chunk (virtual stage) it runs, with interleaving
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
        x = self.received if self.received is not None else model.embedding(mb["tokens"])
        self.embedded = x if self.received is None else None
        seq_length = x.shape[1] * (model.ps.tp_size if model.sequence_parallel else 1)
        rope = model.rope(seq_length, x.device)
        recomputed = recomputed_layers(model)
        for position in model.layer_positions(self.chunk):
            x = yield from self._layer(model.layer_calls[position], _leaf(x), rope, position in recomputed)
        # through the model's forward, so that its hooks see where each backward starts
        if not model.stage.chunks[self.chunk].last:   # its output goes to the next stage
            self.output = model(hidden=x, head_only=True, chunk=self.chunk)
            return
        self.hidden = _leaf(x)
        self.loss_sum = self.loss.add(model(hidden=self.hidden, labels=mb["labels"], loss_mask=mb["loss_mask"],
                                            head_only=True, chunk=self.chunk))

    def backward(self, grad: Optional[torch.Tensor] = None) -> Pass:
        """From the loss, or from ``grad``, the next stage's gradient of ``output``."""
        if grad is None:
            self.loss.backward(self.loss_sum)
            grad = self.hidden.grad
        while self.tape:
            grad = yield from self.tape.pop()(grad)
        if self.embedded is not None:
            _backward([self.embedded], [grad])
        else:
            self.input_grad = grad
        self.shared.accumulate(self.aliases)

    def _layer(self, layer, x: torch.Tensor, rope, recompute: bool):
        node = functools.partial(_node, self.model.ps.device) if recompute else _call
        mlp = getattr(layer, "mlp", None)
        dispatcher = getattr(mlp, "dispatcher", None)
        if dispatcher is None or dispatcher.group is None:   # no all-to-all: one node
            out = node(layer, x, rope)
            self.tape.append(functools.partial(self._dense_backward, x, out))
            return out
        residual, routed = node(_pre, layer, x, rope)
        handle = dispatcher.exchange(routed.counts, x.device)
        dispatched = _Exchanged(routed.rows, handle.recv_splits, handle.send_splits, dispatcher.group)
        yield
        received = dispatched.result()
        _release(routed.rows)
        expert_out = node(_experts, mlp, received, handle)
        if not recompute:
            _release(received)
        combined = _Exchanged(expert_out, handle.send_splits, handle.recv_splits, dispatcher.group)
        yield
        rows, residual_in, weights = combined.result(), _leaf(residual), _leaf(routed.weights)
        _release(expert_out)
        out = node(_post, layer, rows, residual_in, weights, routed)
        if not recompute:
            _release(rows)
        self.tape.append(functools.partial(self._moe_backward, _MoENodes(x, residual, routed, dispatched, expert_out,
                                                                        combined, residual_in, weights, out)))
        return out

    @staticmethod
    def _dense_backward(x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> Pass:
        _backward([out], [grad])
        return x.grad
        yield   # a generator that never hands the turn over: no communication here

    @staticmethod
    def _moe_backward(n: "_MoENodes", grad: torch.Tensor) -> Pass:
        _backward([n.out], [grad])                                       # post
        n.combined.start_reverse()
        yield
        _backward([n.expert_out], [n.combined.grad_of_sent()])          # experts
        n.dispatched.start_reverse()
        yield
        _backward([n.residual, n.routed.weights, n.routed.rows],         # pre
                  [n.residual_in.grad, n.weights.grad, n.dispatched.grad_of_sent()])
        return n.x.grad


@dataclasses.dataclass
class _MoENodes:
    """What a MoE layer's backward needs of its forward's nodes."""
    x: torch.Tensor              # the layer's input (leaf)
    residual: torch.Tensor       # pre's outputs: the residual stream after attention,
    routed: "Routed"             # ... the routing (its rows and combine weights)
    dispatched: _Exchanged
    expert_out: torch.Tensor     # the experts' output, in the order it was received
    combined: _Exchanged
    residual_in: torch.Tensor    # post's inputs (leaves)
    weights: torch.Tensor
    out: torch.Tensor            # the layer's output


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
