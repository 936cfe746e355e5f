"""``--compile``: each transformer layer's forward through ``torch.compile`` (as torchtitan compiles
each block), one graph per layer where the layer traces whole.

The layer's ``forward`` is compiled on the instance, never the module registered in
``M6Model.layers``: ``torch.compile(module)`` would wrap it in a module whose parameters are named
``_orig_mod.*``, so checkpoints are the same with the flag on or off. Every caller of the layer
goes through the compiled forward: the model's ``layer_calls``, full recomputation (which reruns
the compiled forward in backward) and offloading (``functional_call`` on the layer, with fetched
weights as the graph's inputs).

A layer first tries one graph (``fullgraph=True``); what dynamo cannot hold in one graph breaks
it: the MoE layer's routing (token counts per expert read into Python), dropout drawn from the
model-parallel RNG stream (attention dropout, residual dropout under sequence parallelism: the
stream is forked with ``get_rng_state``). That layer, and the layers whose code traces the same
way, are then compiled in pieces around the breaks; the fallback and where it broke are logged
once. (``--overlap-param-gather`` waits before a compiled layer, outside its graph: parallel/ddp.py.) Dropout inside an inductor graph draws
with inductor's generator, seeded from torch's default one: the masks differ from eager ones
(same distribution; TP peers still drop replicated activations alike).
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import torch
import torch._dynamo.exc
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

logger = logging.getLogger(__name__)

BACKEND = "inductor"  # torch.compile's default (the tests swap in aot_eager where codegen adds only time)

# What one graph cannot hold: a graph break, or a Python value read from a tensor (``.tolist()``).
_GRAPH_BREAKS = (torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode)
# A frame of dynamo's user stack in this package: path, line, source line.
_OUR_FRAME = re.compile(r'File "[^"]*megatron_p2r/([^"]+)", line (\d+), in \w+\n(.*)')


class CompiledForward:
    """A layer's forward compiled as one graph, or in pieces once one graph proved impossible."""

    def __init__(self, name: str, forward: Callable, backend: str):
        self.name, self.forward, self.backend = name, forward, backend
        self.whole = torch.compile(forward, fullgraph=True, backend=backend)
        self.pieces = None

    def __call__(self, *args, **kwargs):
        if self.pieces is not None:
            return self.pieces(*args, **kwargs)
        try:
            return self.whole(*args, **kwargs)
        except _GRAPH_BREAKS as exc:  # raised while tracing, before anything ran
            logger.warning(
                "--compile: layer %s does not trace as one graph (%s); it and the layers like it are "
                "compiled in pieces around the graph breaks",
                self.name,
                graph_break_reason(exc),
            )
            self.pieces = torch.compile(self.forward, backend=self.backend)
            return self.pieces(*args, **kwargs)


def graph_break_reason(exc: Exception) -> str:
    """The first line of dynamo's message and the line of ours where the graph broke."""
    text = str(exc).strip()
    frames = _OUR_FRAME.findall(text)
    where = f" at megatron_p2r/{frames[-1][0]}:{frames[-1][1]}: {frames[-1][2].strip()}" if frames else ""
    return text.splitlines()[0] + where


def compile_layers(layers: nn.ModuleDict) -> None:
    """Compile the forward of every layer in ``layers`` (``M6Model.layers``), in place; parameter
    names are unchanged."""
    for name, layer in layers.items():
        layer.forward = CompiledForward(name, layer.forward, BACKEND)
