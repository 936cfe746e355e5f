"""Megatron-LM checkpoints written as Megatron-LM writes them, without Megatron installed.

Naming and sharding follow NVIDIA/Megatron-LM at commit d98e8a64ddf3 (2026-08-22), read from
its sources, independently of megatron_p2r/convert/megatron:

- module names: megatron/core/models/gpt/gpt_model.py, gpt_layer_specs.py (local spec: separate
  ``input_layernorm``/``pre_mlp_layernorm``; Transformer Engine spec: norms fused as
  ``self_attention.linear_qkv.layer_norm_*`` / ``mlp.linear_fc1.layer_norm_*``, ``_extra_state``
  entries; MoE layers keep ``pre_mlp_layernorm``); experts: transformer/moe/experts.py
  (SequentialMLP ``local_experts.L.linear_fc1.weight``, TEGroupedMLP ``linear_fc1.weightL``);
- TP splits: tensor_parallel/layers.py (column-parallel weights/biases and the vocabulary on dim
  0, row-parallel weights on dim 1, the rest replicated); SwiGLU fc1 holds [gate; up] per TP
  shard (transformer/mlp.py ``glu``: ``torch.chunk(x, 2, dim=-1)``);
- legacy files: training/checkpointing.py ``get_checkpoint_name`` (``mp_rank_TT[_PPP][_EEE]``),
  ``generate_state_dict`` (args, checkpoint_version 3.0, iteration, model, optimizer,
  opt_param_scheduler, rng_state), layers numbered from 0 on each stage, experts from 0 on each
  EP rank; the vocabulary padded to a multiple of make_vocab_size_divisible_by x TP;
- torch_dist: dist_checkpointing (``metadata.json``, ``common.pt``, PyTorch DCP ``.metadata`` and
  ``.distcp`` written by ``torch.distributed.checkpoint.save``); transformer_block.py stacks
  homogeneous layers on a leading dimension; experts.py adds the global expert dimension;
  mlp.py ``apply_swiglu_sharded_factory`` stores gate shard t at chunk t of 2·TP and up shard t
  at chunk TP + t; gpt_layer_specs' ``sharded_state_dict_keys_map`` gives dense layers the TE
  norm names; a tied output layer is not saved.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import json
import os
import random
import sys
import types
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

ITERATION = 7


@dataclasses.dataclass
class Spec:
    """A tiny Megatron model: family gpt (learned positions, LayerNorm, GELU, biases: the
    tanh GELU of Megatron's default bias-GELU fusion), llama
    (rope, RMSNorm, SwiGLU, no biases) or mixtral (llama with top-k MoE in every layer)."""

    family: str
    layers: int = 4
    hidden: int = 32
    heads: int = 4
    groups: int = 0  # key/value heads under --group-query-attention (0: one per query head)
    kv_channels: int = 8  # head dimension
    rotary_percent: float = 1.0
    qk_layernorm: bool = False
    ffn: int = 48
    vocab: int = 200
    divisible_by: int = 16
    experts: int = 0
    topk: int = 2
    seq: int = 16
    untied: bool = True
    layernorm_1p: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def query_groups(self) -> int:
        return self.groups or self.heads

    @property
    def glu(self) -> bool:
        return self.family != "gpt"

    @property
    def bias(self) -> bool:
        return self.family == "gpt"

    def padded_vocab(self, tp: int) -> int:
        multiple = self.divisible_by * tp  # megatron/training/tokenizer: _vocab_size_with_padding
        return -(-self.vocab // multiple) * multiple


GPT = Spec("gpt", ffn=64, untied=False, dtype=torch.float32)
# grouped-query attention with 2 key/value heads of dimension 16 (not hidden/heads), half of each
# head rotated, query/key norms, norm weights stored as gamma - 1 (--apply-layernorm-1p)
LLAMA = Spec("llama", groups=2, kv_channels=16, rotary_percent=0.5, qk_layernorm=True, layernorm_1p=True)
# one key/value head: fewer groups than the source TP (Megatron cuts through the group)
MIXTRAL = Spec("mixtral", ffn=24, experts=4, groups=1)


def megatron_args(spec: Spec, tp: int, pp: int, ep: int, **overrides) -> argparse.Namespace:
    """The args Megatron saves (its own names; a few Megatron-only options for realism)."""
    values = dict(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        ffn_hidden_size=spec.ffn,
        num_attention_heads=spec.heads,
        kv_channels=spec.kv_channels,
        group_query_attention=bool(spec.groups),
        num_query_groups=spec.groups or 1,
        seq_length=spec.seq,
        max_position_embeddings=spec.seq,
        position_embedding_type="learned_absolute" if spec.family == "gpt" else "rope",
        rotary_base=10000,
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=False,
        normalization="LayerNorm" if spec.family == "gpt" else "RMSNorm",
        layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=spec.layernorm_1p,
        swiglu=spec.glu,
        add_bias_linear=spec.bias,
        add_qkv_bias=spec.bias,
        bias_gelu_fusion=spec.bias,
        openai_gelu=False,
        qk_layernorm=spec.qk_layernorm,
        untie_embeddings_and_output_weights=spec.untied,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        apply_residual_connection_post_layernorm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=None,
        make_vocab_size_divisible_by=spec.divisible_by,
        padded_vocab_size=spec.padded_vocab(tp),
        vocab_size=spec.vocab,
        tokenizer_type="NullTokenizer",
        params_dtype=spec.dtype,
        bf16=spec.dtype == torch.bfloat16,
        transformer_impl="transformer_engine",
        moe_grouped_gemm=False,
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
    )
    if spec.experts:
        values.update(
            num_experts=spec.experts,
            moe_router_topk=spec.topk,
            moe_layer_freq=1,
            moe_ffn_hidden_size=spec.ffn,
            moe_router_pre_softmax=False,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=None,
        )
    values.update(overrides)
    return argparse.Namespace(**values)


def make_weights(spec: Spec, tp: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Global tensors under Megatron's module names (experts under their global index; SwiGLU
    fc1 as [gate; up], as torch_dist stores it). Norm weights are what Megatron stores: gamma - 1
    under --apply-layernorm-1p."""
    g = torch.Generator().manual_seed(seed)
    h, rows = spec.hidden, spec.padded_vocab(tp)

    def normal(*shape, std=0.15):
        return (torch.randn(shape, generator=g) * std).to(spec.dtype)

    def norm(prefix: str, size: int = h) -> Dict[str, torch.Tensor]:
        gamma = torch.rand(size, generator=g) + 0.5
        out = {prefix + "weight": (gamma - 1 if spec.layernorm_1p else gamma).to(spec.dtype)}
        if spec.family == "gpt":
            out[prefix + "bias"] = normal(size, std=0.1)
        return out

    def linear(prefix: str, out_dim: int, in_dim: int) -> Dict[str, torch.Tensor]:
        out = {prefix + "weight": normal(out_dim, in_dim)}
        if spec.bias:
            out[prefix + "bias"] = normal(out_dim, std=0.05)
        return out

    w = {"embedding.word_embeddings.weight": normal(rows, h, std=0.5)}
    if spec.family == "gpt":
        w["embedding.position_embeddings.weight"] = normal(spec.seq, h, std=0.5)
    fc1 = spec.ffn * (2 if spec.glu else 1)
    for i in range(spec.layers):
        p = f"decoder.layers.{i}."
        w.update(norm(p + "input_layernorm."))
        d = spec.kv_channels
        w.update(linear(p + "self_attention.linear_qkv.", (spec.heads + 2 * spec.query_groups) * d, h))
        if spec.qk_layernorm:
            w.update(norm(p + "self_attention.q_layernorm.", d))
            w.update(norm(p + "self_attention.k_layernorm.", d))
        w.update(linear(p + "self_attention.linear_proj.", h, spec.heads * d))
        w.update(norm(p + "pre_mlp_layernorm."))
        if spec.experts:
            w[p + "mlp.router.weight"] = normal(spec.experts, h, std=0.5)
            for e in range(spec.experts):
                w.update(linear(f"{p}mlp.experts.{e}.linear_fc1.", fc1, h))
                w.update(linear(f"{p}mlp.experts.{e}.linear_fc2.", h, spec.ffn))
        else:
            w.update(linear(p + "mlp.linear_fc1.", fc1, h))
            w.update(linear(p + "mlp.linear_fc2.", h, spec.ffn))
    w.update(norm("decoder.final_layernorm."))
    if spec.untied:
        w["output_layer.weight"] = normal(rows, h, std=0.3)
    return w


# --- how Megatron splits a global tensor over TP ---------------------------------------------


def _split_dim(name: str) -> Optional[int]:
    module, kind = name.rsplit(".", 2)[-2:]
    if name.startswith(("embedding.word_embeddings", "output_layer")) or module in ("linear_qkv", "linear_fc1"):
        return 0
    return 1 if module in ("linear_proj", "linear_fc2") and kind == "weight" else None


def tp_local(name: str, tensor: torch.Tensor, t: int, tp: int, glu: bool) -> torch.Tensor:
    """TP rank t's local tensor (SwiGLU fc1: its gate rows then its up rows)."""
    dim = _split_dim(name)
    if dim is None:
        return tensor
    if glu and name.rsplit(".", 2)[-2] == "linear_fc1":
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
    return tensor.chunk(tp, dim)[t]


def stage_ranges(layers: int, pp: int, split: Optional[List[int]] = None) -> List[range]:
    counts = split or [layers // pp] * pp
    starts = [sum(counts[:p]) for p in range(pp)]
    return [range(s, s + c) for s, c in zip(starts, counts, strict=True)]


# --- legacy layout ------------------------------------------------------------------------------


@contextlib.contextmanager
def megatron_enums():
    """A stand-in ``megatron.core.transformer.enums`` module, so that the saved args hold a
    Megatron enum value (``args.attention_backend``) pickled under Megatron's own class name."""
    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)

    class AttnBackend(enum.Enum):
        flash, fused, unfused, local, auto = 1, 2, 3, 4, 5

    AttnBackend.__module__, AttnBackend.__qualname__ = "megatron.core.transformer.enums", "AttnBackend"
    sys.modules["megatron.core.transformer.enums"].AttnBackend = AttnBackend
    try:
        yield AttnBackend
    finally:
        for n in added:
            del sys.modules[n]


def fixture_globals(backend) -> list:
    """What a legacy fixture file pickles besides tensors (its args, the enum, numpy's RNG state),
    for re-reading the tests' own files with ``torch.load(weights_only=True)``."""
    import argparse
    import numpy as np

    return [
        argparse.Namespace,
        backend,
        np._core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


_TE_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def _fused_norm_name(rest: str, moe: bool) -> str:
    """Transformer Engine's name of a norm (an MoE layer keeps its own pre_mlp_layernorm)."""
    for norm, fused in _TE_NORMS[:1] if moe else _TE_NORMS:
        if rest.startswith(norm):
            return fused + rest[len(norm) :]
    return rest


def legacy_state(
    spec: Spec, weights: Dict[str, torch.Tensor], t: int, p: int, e: int, layout, stages, te: bool, grouped: bool
) -> Dict[str, torch.Tensor]:
    """The ``model`` state dict of rank (t, p, e)."""
    tp, pp, ep = layout
    local_experts = spec.experts // ep if spec.experts else 0
    sd = {}
    for name, tensor in weights.items():
        if name.startswith("decoder.layers."):
            i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
            if i not in stages[p]:
                continue
            if rest.startswith("mlp.experts."):
                expert, leaf = int(rest.split(".")[2]), rest.split(".", 3)[3]
                if expert // local_experts != e:
                    continue
                j = expert % local_experts
                rest = f"mlp.experts.{leaf}{j}" if grouped else f"mlp.experts.local_experts.{j}.{leaf}"
            elif te:
                rest = _fused_norm_name(rest, bool(spec.experts))
            key = f"decoder.layers.{i - stages[p].start}.{rest}"
        elif p == (0 if name.startswith("embedding.") else pp - 1):  # embeddings first, final norm/output last
            key = name
        else:
            continue
        sd[key] = tp_local(name, tensor, t, tp, spec.glu).clone()
    if p == pp - 1 and not spec.untied and pp > 1:  # the last stage's replica of the tied embedding
        sd["output_layer.weight"] = tp_local(
            "output_layer.weight", weights["embedding.word_embeddings.weight"], t, tp, spec.glu
        ).clone()
    if te:
        for key in [k for k in sd if k.endswith(("linear_qkv.weight", "linear_proj.weight"))]:
            sd[key.rsplit(".", 1)[0] + "._extra_state"] = io.BytesIO()
    return sd


def legacy_rank_dir(t: int, p: int, e: int, layout) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if layout[1] > 1 else "") + (f"_{e:03d}" if layout[2] > 1 else "")


def write_legacy(root: str, spec: Spec, weights, args, layout, split=None, te=False, grouped=False) -> str:
    """``root/iter_0000007/mp_rank_*/model_optim_rng.pt`` and the tracker file, as Megatron saves them."""
    tp, pp, ep = layout
    stages = stage_ranges(spec.layers, pp, split)
    iter_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    with megatron_enums() as backend:
        args = argparse.Namespace(**vars(args), attention_backend=backend.auto)
        for p in range(pp):
            for e in range(ep):
                for t in range(tp):
                    sd = legacy_state(spec, weights, t, p, e, layout, stages, te, grouped)
                    state = {
                        "args": args,
                        "checkpoint_version": 3.0,
                        "iteration": ITERATION,
                        "model": sd,
                        "optimizer": {
                            "state": {0: {"exp_avg": torch.zeros(3), "step": 7}},
                            "param_groups": [{"lr": 1e-4, "params": [0]}],
                        },
                        "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": ITERATION},
                        "rng_state": [
                            {
                                "random_rng_state": random.getstate(),
                                "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(),
                                "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
                            }
                        ],
                        "num_floating_point_operations_so_far": 1.5e12,
                    }
                    path = os.path.join(iter_dir, legacy_rank_dir(t, p, e, layout), "model_optim_rng.pt")
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    torch.save(state, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(ITERATION))
    return iter_dir


# --- torch_dist ---------------------------------------------------------------------------------


def _dcp_chunks_class():
    """A tensor that DCP saves as the given chunks of a global shape (megatron-core's
    dist_checkpointing/strategies/checkpointable.py LocalShardsContainer, in short)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class Chunks(torch.Tensor):
        @staticmethod
        def __new__(cls, shape, chunks):
            return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=chunks[0][1].dtype)

        def __init__(self, shape, chunks):
            self.global_shape = torch.Size(shape)
            self.chunks = [(torch.Size(o), t) for o, t in chunks]

        def __create_write_items__(self, fqn, obj):
            return [
                WriteItem(
                    index=MetadataIndex(fqn, o, i),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=o, sizes=t.shape),
                        properties=TensorProperties.create_from_tensor(t),
                        size=self.global_shape,
                    ),
                )
                for i, (o, t) in enumerate(self.chunks)
            ]

        def __create_chunk_list__(self):
            return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.chunks]

        def __get_tensor_shard__(self, index):
            return next(t for o, t in self.chunks if o == index.offset)

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs=None):
            raise NotImplementedError(func)

    return Chunks


def _tp_chunks(name: str, tensor: torch.Tensor, tp: int, glu: bool) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """(global offsets, chunk) of every TP rank's shard (replicated tensors: rank 0's only)."""
    dim = _split_dim(name)
    if dim is None:
        return [((0,) * tensor.dim(), tensor)]
    if glu and name.rsplit(".", 2)[-2] == "linear_fc1":
        half = tensor.shape[0] // 2
        out = []
        for t in range(tp):  # apply_swiglu_sharded_factory: gate at chunk t, up at chunk tp + t of 2*tp
            for start in (0, half):
                piece = tensor[start : start + half].chunk(tp)[t]
                out.append(((start + t * piece.shape[0],) + (0,) * (tensor.dim() - 1), piece))
        return out
    size = tensor.shape[dim] // tp
    return [
        (tuple(t * size if d == dim else 0 for d in range(tensor.dim())), piece)
        for t, piece in enumerate(tensor.chunk(tp, dim))
    ]


def dist_state(spec: Spec, weights: Dict[str, torch.Tensor], tp: int, stacked: bool) -> dict:
    """key -> (global shape, chunks) as megatron-core's sharded_state_dict makes them."""
    out: Dict[str, Tuple[tuple, list]] = {}
    for name, tensor in weights.items():
        if not name.startswith("decoder.layers."):
            if name == "output_layer.weight" and not spec.untied:
                continue
            out[name] = (tuple(tensor.shape), _tp_chunks(name, tensor, tp, spec.glu))
            continue
        i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
        lead, index = ((), ()) if not stacked else ((spec.layers,), (i,))
        layer_prefix = "decoder.layers." if stacked else f"decoder.layers.{i}."
        if rest.startswith("mlp.experts."):
            _, _, e, leaf = rest.split(".", 3)
            key, lead, index = layer_prefix + "mlp.experts." + leaf, lead + (spec.experts,), index + (int(e),)
        else:
            key = layer_prefix + _fused_norm_name(rest, bool(spec.experts))
        shape, chunks = out.setdefault(key, (lead + tuple(tensor.shape), []))
        chunks += [
            (index + o, c.reshape((1,) * len(index) + tuple(c.shape)))
            for o, c in _tp_chunks(name, tensor, tp, spec.glu)
        ]
    return out


def write_torch_dist(root: str, spec: Spec, weights, args, layout, stacked: bool = True) -> str:
    """``root/iter_0000007/`` as megatron-core's torch_dist strategy writes it, and the tracker."""
    import torch.distributed.checkpoint as dcp

    chunks_class = _dcp_chunks_class()
    iter_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(iter_dir)
    state = {
        key: chunks_class(shape, [(o, c.clone()) for o, c in chunks])
        for key, (shape, chunks) in dist_state(spec, weights, layout[0], stacked).items()
    }
    state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(2, 3)  # not read
    state["rng_state"] = io.BytesIO(b"rng")
    state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_4"] = io.BytesIO(b"")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(iter_dir, thread_count=2), no_dist=True)
    with megatron_enums() as backend:
        torch.save(
            {
                "args": argparse.Namespace(**vars(args), attention_backend=backend.auto),
                "checkpoint_version": 3.0,
                "iteration": ITERATION,
                "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": ITERATION},
            },
            os.path.join(iter_dir, "common.pt"),
        )
    with open(os.path.join(iter_dir, "metadata.json"), "w") as fh:
        json.dump(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            },
            fh,
        )
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(ITERATION))
    return iter_dir
