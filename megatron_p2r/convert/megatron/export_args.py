"""Our model options -> the ``args`` Megatron-LM saves with a checkpoint, as plain data.

Megatron reads these back when it loads: ``check_checkpoint_args`` compares num_layers,
hidden_size, num_attention_heads, add_position_embedding (and the vocabulary options with a
vocab file); ``--use-checkpoint-args`` takes the whole model from them; torch_dist loading
reads the TP/PP sizes and ``no_save_optim`` / ``no_save_rng``, which say there is no optimizer
or RNG state to load. Only str, int, float, bool, None, lists and tuples are written, so the
``argparse.Namespace`` loads with ``torch.load(weights_only=True)`` under megatron-core's
allow-list (and ours). The args are checked by reading them back with the importer's own
reader (args.py): an option it would not map back to ours exactly is refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import List, Tuple

from megatron_p2r.config import Config, ModelConfig
from megatron_p2r.config.layer_pattern import layer_pattern_text
from megatron_p2r.convert.megatron.args import MegatronConversionError, SavedArgs, model_values

CHECKPOINT_VERSION = 3.0
# What megatron-core 0.16 records in common.pt about how the sharded state dict was built.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """The Megatron run the checkpoint is written for: its TP, PP and EP sizes and format."""

    tp: int
    pp: int
    ep: int
    ckpt_format: str  # "torch_dist" or "torch" (legacy)


def check_expressible(m: ModelConfig) -> None:
    """Refuse, naming each, the options of ours that Megatron-LM's GPT model cannot express."""
    blockers = []
    if m.yarn:
        blockers.append(
            "--rope-type yarn (Megatron-LM's command line builds YaRN for --multi-latent-attention only; "
            "export-hf writes it)"
        )
    if m.num_experts and m.add_bias and not m.router_bias:
        blockers.append("--no-moe-router-bias (megatron-core's router has a bias under --add-bias-linear)")
    if m.num_experts and m.moe_num_prototypes != 1:
        blockers.append(f"--moe-num-prototypes {m.moe_num_prototypes} (expert prototyping)")
    if blockers:
        raise MegatronConversionError("cannot express this model in Megatron-LM: " + "; ".join(blockers))


def megatron_vocab(m: ModelConfig, tp: int) -> Tuple[int, int]:
    """(vocab_size, make_vocab_size_divisible_by) whose Megatron padding at TP ``tp`` gives our
    padded rows: Megatron pads to a multiple of divisor x TP, ours to a multiple of divisor."""
    rows, divisor = m.padded_vocab_size, m.make_vocab_size_divisible_by
    if divisor % tp == 0:
        return m.vocab_size, divisor // tp
    if rows % tp:
        raise MegatronConversionError(
            f"the padded vocabulary ({rows} rows) does not split over Megatron's tensor-parallel size {tp}"
        )
    return m.vocab_size, rows // tp


def _model_args(m: ModelConfig) -> dict:
    return dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.head_dim,
        group_query_attention=m.group_query_attention,
        num_query_groups=m.query_groups,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_positions,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=True,
        use_rotary_position_embeddings=False,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        use_rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        rotary_seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
        rotary_interleaved=False,
        normalization=m.normalization,
        norm_epsilon=m.norm_epsilon,
        apply_layernorm_1p=False,
        swiglu=m.swiglu,
        squared_relu=False,
        add_bias_linear=m.add_bias,
        # Megatron's dense MLP has no fused quick-GeGLU kernel: it needs the fusion off
        add_qkv_bias=m.add_qkv_bias,
        bias_gelu_fusion=m.bias_gelu_fusion and not m.quick_geglu,
        qk_layernorm=m.qk_layernorm,
        qk_l2_norm=m.qk_l2_norm,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=False,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor if m.mtp_num_layers else None,
        **_gpt_oss_args(m),
        **_latent_args(m),
    )


def _latent_args(m: ModelConfig) -> dict:
    """Multi-latent attention's args (MLA's rope is YaRN in Megatron-LM: --rope-type yarn)."""
    if not m.multi_latent_attention:
        return dict(multi_latent_attention=False)
    return dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="yarn",
        rotary_scaling_factor=m.rotary_scaling_factor,
        mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim,
    )


def _gpt_oss_args(m: ModelConfig) -> dict:
    """Windows, sinks and the gated MLP's options as Megatron saves them (``--window-size`` as the
    tuple (L, 0))."""
    window = tuple(int(x) for x in m.window_size.strip("()").split(",")) if m.window_size else None
    return dict(
        window_size=window,
        window_attn_skip_freq=m.window_attn_skip_freq if window else None,
        softmax_type=m.softmax_type,
        quick_geglu=m.quick_geglu,
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.activation_func_clamp_value,
    )


def _moe_args(m: ModelConfig) -> dict:
    if not m.num_experts:
        return dict(num_experts=None)
    balancing = m.moe_router_load_balancing_type if m.moe_aux_loss_coeff else "none"
    return dict(
        num_experts=m.num_experts,
        moe_layer_freq=m.moe_layer_freq,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.expert_ffn_size,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff or None,
        moe_input_jitter_eps=m.moe_input_jitter_eps,
        moe_grouped_gemm=False,
        moe_router_score_function=m.moe_router_score_function,
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_shared_expert_overlap=m.moe_shared_expert_overlap,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_expert_capacity_factor=m.moe_capacity_factor,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
    )


def flags_to_pass(args: argparse.Namespace) -> List[str]:
    """The Megatron flags of the exported model that ``--use-checkpoint-args`` does not take from
    the checkpoint (``load_args_from_checkpoint`` restores only its list), where they differ from
    Megatron's defaults: pass them with it."""
    flags = []
    if args.make_vocab_size_divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by)]
    if args.norm_epsilon != 1e-5:
        flags += ["--norm-epsilon", repr(args.norm_epsilon)]
    if args.qk_layernorm:
        flags.append("--qk-layernorm")
    if args.qk_l2_norm:
        flags.append("--qk-l2-norm")
    if not args.bias_gelu_fusion and args.add_bias_linear and not args.swiglu:
        flags.append("--no-bias-gelu-fusion")
    if args.num_experts and args.moe_aux_loss_coeff:
        balancing = args.moe_router_load_balancing_type
        flags += ["--moe-router-load-balancing-type", balancing, "--moe-aux-loss-coeff", repr(args.moe_aux_loss_coeff)]
    if args.num_experts and args.moe_z_loss_coeff:
        flags += ["--moe-z-loss-coeff", repr(args.moe_z_loss_coeff)]
    if args.num_experts and args.moe_expert_capacity_factor is not None:
        flags += ["--moe-expert-capacity-factor", repr(args.moe_expert_capacity_factor)]
        flags += ["--moe-token-drop-policy", args.moe_token_drop_policy]
        flags += ["--moe-pad-expert-input-to-capacity"] if args.moe_pad_expert_input_to_capacity else []
    return flags + _gpt_oss_flags(args) + _deepseek_flags(args)


def _deepseek_flags(args: argparse.Namespace) -> List[str]:
    """MLA's, the group-limited routing's, the bias update rate's, the shared-expert gate's and
    MTP's flags (not restored by --use-checkpoint-args; the routing's score function, scaling,
    expert bias and shared experts are)."""
    flags = []
    if args.multi_latent_attention:
        flags.append("--multi-latent-attention")
        if args.q_lora_rank is not None:
            flags += ["--q-lora-rank", str(args.q_lora_rank)]
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type"):
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
            flags += [f"--{name.replace('_', '-')}", repr(getattr(args, name))]
    if args.num_experts and args.moe_router_group_topk:
        flags += ["--moe-router-num-groups", str(args.moe_router_num_groups)]
        flags += ["--moe-router-group-topk", str(args.moe_router_group_topk)]
    if args.num_experts and args.moe_router_enable_expert_bias:
        flags += ["--moe-router-bias-update-rate", repr(args.moe_router_bias_update_rate)]
    if args.num_experts and args.moe_shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
    if args.mtp_num_layers:
        flags += ["--mtp-num-layers", str(args.mtp_num_layers)]
        flags += ["--mtp-loss-scaling-factor", repr(args.mtp_loss_scaling_factor)]
    return flags


def _gpt_oss_flags(args: argparse.Namespace) -> List[str]:
    flags = []
    if args.window_size:
        flags += ["--window-size", ",".join(map(str, args.window_size))]
    if args.window_attn_skip_freq:
        freq = args.window_attn_skip_freq
        flags += ["--window-attn-skip-freq", layer_pattern_text(freq) if isinstance(freq, list) else str(freq)]
    if args.softmax_type != "vanilla":
        flags += ["--softmax-type", args.softmax_type]
    if args.quick_geglu:
        flags.append("--quick-geglu")
    if args.glu_linear_offset:
        flags += ["--glu-linear-offset", repr(args.glu_linear_offset)]
    if args.activation_func_clamp_value is not None:
        flags += ["--activation-func-clamp-value", repr(args.activation_func_clamp_value)]
    return flags


def megatron_args(
    cfg: Config, layout: MegatronLayout, *, iteration: int, consumed_samples: int, dtype: str, optimizer: bool = False
) -> argparse.Namespace:
    """The args of a checkpoint of the real model ``cfg`` written for ``layout`` (with the
    optimizer state or not), checked by reading them back."""
    m = cfg.model
    check_expressible(m)
    vocab, divisor = megatron_vocab(m, layout.tp)
    values = _model_args(m)
    values.update(_moe_args(m))
    values.update(
        vocab_size=vocab,
        make_vocab_size_divisible_by=divisor,
        padded_vocab_size=m.padded_vocab_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        ckpt_format=layout.ckpt_format,
        use_dist_ckpt=layout.ckpt_format != "torch",
        no_save_optim=not optimizer,
        no_save_rng=True,
        iteration=iteration,
        consumed_train_samples=consumed_samples,
        consumed_valid_samples=0,
        skipped_train_samples=0,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        tokenizer_type=cfg.data.tokenizer_type,
        tokenizer_model=cfg.data.tokenizer_model,
        vocab_file=cfg.data.vocab_file,
        merge_file=cfg.data.merge_file,
        tiktoken_pattern=cfg.data.tiktoken_pattern,
        tiktoken_num_special_tokens=cfg.data.tiktoken_num_special_tokens,
        tokenizer_special_tokens=cfg.data.tiktoken_special_tokens,
    )
    args = argparse.Namespace(**values)
    _check_round_trip(args, m)
    return args


# Fields whose unset value means a default: compared through the value the model uses.
_DERIVED = {
    "ffn_hidden_size": "ffn_size",
    "moe_ffn_hidden_size": "expert_ffn_size",
    "kv_channels": "head_dim",
    "max_position_embeddings": "max_positions",
    "num_query_groups": "query_groups",
    "bias_gelu_fusion": "gelu_approximation",
    "rope_type": "rotary_type",  # unset is Megatron-LM's default kind
}


def _effective(m: ModelConfig, name: str):
    value = getattr(m, _DERIVED.get(name, name))
    return value or None if name == "num_experts" else value


def model_differences(ours: ModelConfig, theirs: ModelConfig) -> List[str]:
    """The options on which two models differ as functions (an unset default equals its value;
    MoE options count only in an MoE model), each as ``--option ours (theirs)``."""
    names = [f.name for f in dataclasses.fields(ModelConfig) if ours.num_experts or not f.name.startswith("moe_")]
    return [
        f"--{name.replace('_', '-')} {_effective(ours, name)!r} (reads back as {_effective(theirs, name)!r})"
        for name in names
        if _effective(theirs, name) != _effective(ours, name)
    ]


def _check_round_trip(args: argparse.Namespace, m: ModelConfig) -> None:
    """The importer reads ``args`` back as exactly our model, or the export is refused."""
    read, zero_centered, _ = model_values(SavedArgs.of(args, "the exported args"))
    theirs = Config.from_dict(
        {"model": {**read, "vocab_size": m.vocab_size, "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by}}
    ).model
    differ = model_differences(m, theirs)
    if differ or zero_centered:
        raise MegatronConversionError("cannot express this model in Megatron-LM's args: " + "; ".join(differ))
