"""What running a stage node by node (``--overlap-moe-expert-parallel-comm``,
``pipeline/a2a_overlap.py``) needs of the model besides each layer's nodes (``moe/nodes.py``):
a node's inputs are fresh leaves, its backward is autograd's from its outputs, and the weights
several nodes read have their gradients summed before they are accumulated (``SharedWeights``)."""

from __future__ import annotations

import collections
import contextlib
from typing import List, Optional

import torch
from torch import nn


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A node's input: ``t`` cut from the graph that made it; its gradient is the node's to hand back."""
    return t.detach().requires_grad_(True)


def node_backward(outputs: List[torch.Tensor], grads: List[Optional[torch.Tensor]]) -> None:
    """Back-propagate a node's output gradients (those that reached it) through its graph."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


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
        self.slots = [
            (m, name, p)
            for module in shared.values()
            for m in module.modules()
            for name, p in m.named_parameters(recurse=False)
        ]
        if model.embedding is not None and model.final_norm is not None and model.output_layer is None:
            word = model.embedding.word_embeddings  # tied: the output layer reads the embedding's matrix
            self.slots.append((word, "weight", word.weight))

    def aliases(self) -> List[torch.Tensor]:
        return [leaf(p) for _, _, p in self.slots]

    @contextlib.contextmanager
    def read_through(self, aliases: List[torch.Tensor]):
        """The modules read ``aliases`` instead of their weights while inside."""
        for (module, name, _), alias in zip(self.slots, aliases, strict=True):
            module._parameters[name] = alias
        try:
            yield
        finally:
            for module, name, p in self.slots:
                module._parameters[name] = p

    def accumulate(self, aliases: List[torch.Tensor]) -> None:
        node_backward([p for _, _, p in self.slots], [a.grad for a in aliases])
