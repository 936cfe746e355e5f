"""Megatron-LM's saved args -> our model options, or an error naming every option that has no
equivalent here.

Names and defaults are Megatron-LM's (``megatron/training/arguments.py`` and the
``TransformerConfig`` fields it exposes); an arg missing from an older checkpoint takes its
Megatron default. Options that only pick kernels or change training but not the function
(fusions other than bias-GELU, dispatcher, recompute, dtypes) are not read, nor is
``openai_gelu``, which megatron-core never reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from numbers import Real
from typing import Any, List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.hf.config_json import import_vocab_divisor
from megatron_p2r.convert.megatron.unpickler import shown
from megatron_p2r.config import ConfigError

_MISSING = object()


class MegatronConversionError(ConfigError):
    """A Megatron model that cannot be expressed here; the message names every blocking option."""


# Options that change the forward pass and have no equivalent here: (arg, its neutral value, why).
_NEUTRAL = [
    ("apply_residual_connection_post_layernorm", False, "post-norm residuals (ours are pre-norm)"),
    ("mtp_num_layers", None, "multi-token prediction layers"),
    ("softmax_scale", None, "a custom attention softmax scale"),
    ("attention_output_gate", False, "gated attention output"),
    ("no_rope_freq", None, "layers without rotary embeddings"),
    ("experimental_attention_variant", None, "an experimental attention variant"),
    ("linear_attention_freq", None, "linear-attention layers"),
    ("heterogeneous_layers_config_path", None, "heterogeneous layers"),
    ("rotary_interleaved", False, "interleaved rotary embeddings (ours rotate halves)"),
    ("squared_relu", False, "squared-ReLU MLP"),
    ("moe_shared_expert_intermediate_size", None, "shared experts"),
    ("moe_router_score_function", "softmax", "a router score function other than softmax"),
    ("moe_router_topk_scaling_factor", None, "scaled top-k routing weights"),
    ("moe_router_num_groups", None, "group-limited routing"),
    ("moe_router_enable_expert_bias", False, "expert-bias (aux-loss-free) routing"),
    ("moe_latent_size", None, "latent MoE projections"),
    ("moe_apply_probs_on_input", False, "routing weights applied to expert inputs"),
    ("use_mup", False, "muP scaling"),
]


# What each arg read here must be when present (None: Megatron's "unset"); checked before any is
# used, so a wrongly typed value is an error naming it, not a traceback or a misleading comparison.
_SIZE_LIMIT = 2**31 - 1  # a count of heads, rows ...: larger is no model (and no allocation)
_LIMITS = {"num_layers": 2**16, "num_experts": 2**16, "num_moe_experts": 2**16}  # looped over per layer/expert
_POSITIVE_INTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "kv_channels",
    "num_query_groups",
    "max_position_embeddings",
    "seq_length",
    "padded_vocab_size",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "data_parallel_size",
    "ddp_bucket_size",
    "num_experts",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
)
_REALS = (
    "rotary_base",
    "rotary_percent",
    "layernorm_epsilon",
    "norm_epsilon",
    "attention_dropout",
    "hidden_dropout",
    "init_method_std",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "moe_z_loss_coeff",
    "moe_input_jitter_eps",
    "moe_expert_capacity_factor",
)
_STRINGS = ("position_embedding_type", "normalization", "softmax_type", "tokenizer_type", "moe_token_drop_policy")
# an arg Megatron also accepts per layer (a list): one value, or a flat list of such values
_PER_LAYER = {
    "moe_layer_freq": "int",
    "window_attn_skip_freq": "int",
    "moe_router_load_balancing_type": "str",
    "moe_aux_loss_coeff": "real",
}


def _is_int(value, low: int = 1, high: int = _SIZE_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


_KIND = {
    "int": (_is_int, "an integer >= 1"),
    "real": (_is_real, "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _type_problem(name: str, value) -> Optional[str]:
    """What is wrong with the saved arg ``name`` = ``value`` (None when nothing)."""
    if value is None:
        return None
    kind = (
        "int"
        if name in _POSITIVE_INTS
        else "real"
        if name in _REALS
        else "str"
        if name in _STRINGS
        else _PER_LAYER.get(name)
    )
    if name == "window_size":
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_int(x, 0) for x in value)
        return None if ok else "a pair of integers (L, R) >= 0"
    if kind is None:
        return None
    ok, what = _KIND[kind]
    high = _LIMITS.get(name, _SIZE_LIMIT)
    if kind == "int" and name not in _PER_LAYER:
        return None if _is_int(value, 1, high) else f"an integer from 1 to {high}"
    if name in _PER_LAYER and isinstance(value, (list, tuple)):
        good = 0 < len(value) <= _SIZE_LIMIT and all(ok(x) or (kind == "int" and _is_int(x, 0)) for x in value)
        return None if good else f"{what}, or a list of them (one per layer)"
    return None if ok(value) else what


@dataclasses.dataclass
class SavedArgs:
    """The ``args`` Megatron saved (an argparse.Namespace), and the file it came from."""

    values: dict
    where: str

    @classmethod
    def of(cls, namespace: Any, where: str) -> "SavedArgs":
        if not isinstance(namespace, argparse.Namespace):
            raise CheckpointError(
                f"{where}: 'args' is {type(namespace).__name__}, expected Megatron's saved argparse.Namespace"
            )
        values = vars(namespace)
        for name, value in values.items():
            problem = _type_problem(name, value) if isinstance(name, str) else None
            if problem:
                raise CheckpointError(
                    f"{where}: args.{name} is {shown(value)} ({type(value).__name__}), expected {problem}"
                )
        return cls(values, where)

    def get(self, *names: str, default=None):
        """The first of ``names`` the args hold (newer Megatron renamed some), else ``default``."""
        for name in names:
            value = self.values.get(name, _MISSING)
            if value is not _MISSING:
                return value
        return default

    def required(self, name: str):
        value = self.values.get(name)
        if value is None:
            raise CheckpointError(f"{self.where}: args.{name} is missing")
        return value

    @property
    def tp(self) -> int:
        return int(self.get("tensor_model_parallel_size", default=1) or 1)

    @property
    def pp(self) -> int:
        return int(self.get("pipeline_model_parallel_size", default=1) or 1)

    @property
    def ep(self) -> int:
        return int(self.get("expert_model_parallel_size", default=1) or 1)


def _single(value, name: str, blockers: List[str]):
    """Megatron accepts a list for some per-layer options; one value is all we can express."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            blockers.append(f"{name} {shown(list(value))} (one value for every layer here)")
            return value[0] if value else None
        return value[0]
    return value


def _attention_values(a: SavedArgs, blockers: List[str]) -> dict:
    h, heads = a.required("hidden_size"), a.required("num_attention_heads")
    position = a.get("position_embedding_type", default="learned_absolute")
    if a.get("use_rotary_position_embeddings"):  # Megatron before the option had a type
        position = "rope"
    if position not in ("learned_absolute", "rope"):
        blockers.append(f"--position-embedding-type {position}")
    max_pos = a.get("max_position_embeddings") or a.required("seq_length")
    values = dict(
        hidden_size=h,
        num_attention_heads=heads,
        position_embedding_type=position,
        rotary_base=float(a.get("rotary_base", default=10000)),
        rotary_percent=float(a.get("rotary_percent", default=1.0)),
        max_position_embeddings=max_pos,
        seq_length=min(a.get("seq_length") or max_pos, max_pos),
        attention_dropout=a.get("attention_dropout", default=0.1),
        qk_layernorm=bool(a.get("qk_layernorm")) and not a.get("qk_l2_norm"),  # megatron-core builds only the L2 norm
        qk_l2_norm=bool(a.get("qk_l2_norm")),
        add_qkv_bias=bool(a.get("add_qkv_bias")) and not a.get("add_bias_linear", default=True),
    )
    if a.get("use_rope_scaling"):
        values.update(use_rope_scaling=True, rope_scaling_factor=float(a.get("rope_scaling_factor") or 8.0))
    if a.get("rotary_seq_len_interpolation_factor") is not None:
        values["rotary_seq_len_interpolation_factor"] = a.get("rotary_seq_len_interpolation_factor")
    if a.get("multi_latent_attention"):
        values.update(_latent_values(a, blockers))
    elif a.get("kv_channels") not in (None, h // heads):
        values["kv_channels"] = a.get("kv_channels")
    if a.get("group_query_attention"):
        values.update(group_query_attention=True, num_query_groups=a.get("num_query_groups") or 1)
    return values


def _latent_values(a: SavedArgs, blockers: List[str]) -> dict:
    """Multi-latent attention's args (Megatron-LM's defaults where missing); MLA's --rope-type
    defaults to YaRN, and plain rope is the same tables only with --rotary-scaling-factor 1."""
    factor = float(a.get("rotary_scaling_factor", default=1.0))
    if a.get("rope_type") == "rope" and factor != 1.0:
        blockers.append(f"--rope-type rope with --rotary-scaling-factor {factor} (MLA's rope here is YaRN)")
    return dict(
        multi_latent_attention=True,
        q_lora_rank=a.get("q_lora_rank"),
        kv_lora_rank=a.get("kv_lora_rank", default=32),
        qk_head_dim=a.get("qk_head_dim", default=128),
        qk_pos_emb_head_dim=a.get("qk_pos_emb_head_dim", default=64),
        v_head_dim=a.get("v_head_dim", default=128),
        rotary_scaling_factor=factor,
        mscale=float(a.get("mscale", default=1.0)),
        mscale_all_dim=float(a.get("mscale_all_dim", default=0.0)),
    )


def _window_values(a: SavedArgs, blockers: List[str]) -> dict:
    """Sliding windows (Megatron saves ``--window-size`` as the tuple (L, R)) and attention sinks."""
    values = {}
    softmax = a.get("softmax_type", default="vanilla")
    if softmax not in ("vanilla", "off-by-one", "learnable"):
        blockers.append(f"--softmax-type {softmax!r}")
    else:
        values["softmax_type"] = softmax
    window = a.get("window_size")
    if not window:
        return values
    if not isinstance(window, (tuple, list)) or len(window) != 2 or window[0] < 0 or window[1] != 0:
        blockers.append(f"--window-size {shown(window)} (a causal window (L, 0) with L >= 0 here)")
        return values
    freq = a.get("window_attn_skip_freq")
    if isinstance(freq, (tuple, list)):  # Megatron's per-layer form (1: windowed), read as is
        freq = None if all(freq) else [int(bool(x)) for x in freq]
    return dict(values, window_size=f"{window[0]},0", window_attn_skip_freq=freq)


def _mlp_values(a: SavedArgs) -> dict:
    """The MLP, its GELU included: ``ModelConfig.gelu_approximation`` applies Megatron's rule to
    the same three args (tanh with biases and the bias-GELU fusion, Megatron's default). The GLU
    offset and clamp are read only with a gated MLP: Megatron's other MLPs ignore them."""
    values = dict(
        ffn_hidden_size=a.get("ffn_hidden_size"),
        swiglu=bool(a.get("swiglu")),
        quick_geglu=bool(a.get("quick_geglu")),
        disable_bias_linear=not a.get("add_bias_linear", default=True),
        bias_gelu_fusion=bool(a.get("bias_gelu_fusion", default=True)),
    )
    if values["swiglu"] or values["quick_geglu"]:
        values.update(
            glu_linear_offset=float(a.get("glu_linear_offset") or 0.0),
            activation_func_clamp_value=a.get("activation_func_clamp_value"),
        )
    return values


def _moe_values(a: SavedArgs, blockers: List[str]) -> dict:
    experts = a.get("num_experts", "num_moe_experts")
    if not experts:
        return {}
    freq = a.get("moe_layer_freq", default=1)
    layers = a.required("num_layers")
    pattern = list(freq) if isinstance(freq, (list, tuple)) else [int(i % freq == 0) for i in range(layers)]
    if not all(pattern):
        blockers.append(
            f"--moe-layer-freq {shown(freq)} (MoE layers {shown(pattern)}: reading a checkpoint with dense and "
            "MoE layers mixed is not built yet; only an MoE in every layer maps)"
        )
    balancing = _single(
        a.get("moe_router_load_balancing_type", default="aux_loss"), "--moe-router-load-balancing-type", blockers
    )
    if balancing not in ("aux_loss", "none"):
        blockers.append(f"--moe-router-load-balancing-type {balancing} (ours is the Switch aux loss)")
    coeff = _single(a.get("moe_aux_loss_coeff", default=0.0), "--moe-aux-loss-coeff", blockers)
    return dict(
        num_experts=experts,
        moe_router_topk=a.get("moe_router_topk", default=2),
        moe_layer_freq=1,
        moe_ffn_hidden_size=a.get("moe_ffn_hidden_size"),
        moe_router_pre_softmax=bool(a.get("moe_router_pre_softmax")),
        moe_aux_loss_coeff=float(coeff or 0.0) if balancing == "aux_loss" else 0.0,
        moe_z_loss_coeff=float(a.get("moe_z_loss_coeff") or 0.0),
        moe_input_jitter_eps=a.get("moe_input_jitter_eps"),
        **_capacity_values(a, blockers),
    )


def _capacity_values(a: SavedArgs, blockers: List[str]) -> dict:
    """Megatron's capacity: a negative factor is dropless there (TransformerConfig sets it None)."""
    factor = a.get("moe_expert_capacity_factor")
    if factor is None or factor < 0:
        return {}
    policy = a.get("moe_token_drop_policy", default="probs")
    if policy not in ("probs", "position"):
        blockers.append(f"--moe-token-drop-policy {policy} (probs or position)")
    return dict(
        moe_capacity_factor=float(factor),
        moe_token_drop_policy=policy,
        moe_pad_expert_input_to_capacity=bool(a.get("moe_pad_expert_input_to_capacity")),
    )


def model_values(a: SavedArgs) -> Tuple[dict, bool, List[str]]:
    """({ModelConfig field: value}, zero_centered_gamma, notes) for Megatron's saved args; a
    ``MegatronConversionError`` lists every option that blocks the import."""
    blockers: List[str] = []
    notes: List[str] = []
    for name, neutral, why in _NEUTRAL:
        value = a.get(name, default=neutral)
        if value not in (neutral, None, 0, False):
            blockers.append(f"--{name.replace('_', '-')} {shown(value)} ({why})")
    normalization = a.get("normalization", default="LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        blockers.append(f"--normalization {normalization}")
    values = dict(
        num_layers=a.required("num_layers"),
        normalization=normalization,
        norm_epsilon=float(a.get("layernorm_epsilon", "norm_epsilon", default=1e-5)),
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
        hidden_dropout=a.get("hidden_dropout", default=0.1),
        init_method_std=a.get("init_method_std", default=0.02),
    )
    values.update(_attention_values(a, blockers))
    values.update(_window_values(a, blockers))
    values.update(_mlp_values(a))
    values.update(_moe_values(a, blockers))
    if blockers:
        raise MegatronConversionError(f"{a.where}: cannot express this Megatron-LM model here: " + "; ".join(blockers))
    zero_centered = bool(a.get("layernorm_zero_centered_gamma", "apply_layernorm_1p"))
    if zero_centered:
        notes.append("--apply-layernorm-1p: Megatron stores norm weights as gamma - 1; imported as gamma")
    return {k: v for k, v in values.items() if v is not None}, zero_centered, notes


def vocab_values(a: SavedArgs, target_tp: int) -> Tuple[int, int, Optional[str]]:
    """(vocab_size, make_vocab_size_divisible_by, note) so that our padded vocabulary has
    Megatron's ``padded_vocab_size`` rows P whenever the target TP allows.

    Megatron pads the tokenizer's vocabulary V to a multiple of divisor x TP; V itself is saved
    only with --vocab-size. Our divisor divisor x source TP pads the same V to the same P, so
    training with the tokenizer again (which sets --vocab-size V) gives P rows too."""
    rows = a.required("padded_vocab_size")
    divisor = int(a.get("make_vocab_size_divisible_by", default=128)) * a.tp
    vocab = a.get("vocab_size") or rows
    if -(-vocab // divisor) * divisor != rows:
        vocab, divisor = rows, import_vocab_divisor(rows, target_tp)
    if divisor % target_tp:
        divisor = divisor * target_tp // math.gcd(divisor, target_tp)
    padded = -(-vocab // divisor) * divisor
    note = None
    if padded != rows:
        note = (
            f"vocabulary padded from Megatron's {rows} rows to {padded} with zeros (TP {target_tp} needs "
            f"--make-vocab-size-divisible-by {divisor}); their logits (0) enter our softmax"
        )
    return vocab, divisor, note
