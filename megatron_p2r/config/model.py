"""The model section: the transformer's shape, MoE and the rules that need nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.layer_pattern import LayerPattern, expand_layer_pattern
from megatron_p2r.config.ranges import LAYERS, Range, at_least, fraction, positive


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = opt(4, "Number of transformer layers L.")
    hidden_size: int = opt(256, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = opt(None, "Dense MLP hidden size (default 4*hidden).")
    num_attention_heads: int = opt(4, "Number of attention heads.")
    group_query_attention: bool = opt(
        False,
        "Grouped-query attention: keys and values have --num-query-groups "
        "heads, each shared by num-attention-heads/num-query-groups query heads.",
    )
    num_query_groups: int = opt(
        1, "Key/value heads under --group-query-attention (ignored without it, as in Megatron-LM)."
    )
    kv_channels: Optional[int] = opt(
        None, "Dimension of each attention head (default hidden-size / num-attention-heads)."
    )
    qk_layernorm: bool = opt(
        False, "Normalise every query and key head (--normalization over the head dimension) before rotary embeddings."
    )
    qk_layernorm_over_heads: bool = opt(
        False,
        "With --qk-layernorm: one RMSNorm over the whole query (and the whole key) projection, all "
        "heads together, with a weight per row (OLMo 2), instead of one per head; under TP its mean "
        "square is all-reduced. No Megatron-LM flag.",
    )
    qk_l2_norm: bool = opt(
        False,
        "L2-normalise every query and key head before rotary embeddings, no weights (Llama 4's, "
        "megatron-core's L2Norm: x / sqrt(mean(x^2) + --norm-epsilon), in fp32).",
    )
    add_qkv_bias: bool = opt(False, "Bias in the query/key/value projection even with --disable-bias-linear (Qwen2).")
    window_size: Optional[str] = opt(
        None,
        "Sliding-window attention 'L,0': a query sees itself and the L keys before "
        "it (Megatron-LM's form; Hugging Face's sliding_window is L+1). Unset: full "
        "causal attention.",
    )
    window_attn_skip_freq: Optional[LayerPattern] = opt(
        None,
        "With --window-size, every N-th layer (layers N-1, 2N-1, ... counting from 0) has full "
        "attention, or a list expression of one 0/1 a layer (1: windowed), e.g. '([1]*5+[0])*2'; "
        "unset: every layer is windowed.",
    )
    attn_logit_softcapping: Optional[float] = opt(
        None,
        "Soft-cap the attention scores at C: C * tanh(scores / C) before the mask and softmax (Gemma 2's "
        "attn_logit_softcapping; an attention core of ours, SDPA has none). No Megatron-LM flag.",
    )
    final_logit_softcapping: Optional[float] = opt(
        None,
        "Soft-cap the output logits at C: C * tanh(logits / C), before the loss (Gemma 2's "
        "final_logit_softcapping). No Megatron-LM flag.",
    )
    softmax_type: str = opt(
        "vanilla",
        "Attention softmax: 'off-by-one' adds exp(0) to each denominator, 'learnable' "
        "exp(a_h) with a learned logit a_h per head (attention sinks, gpt-oss).",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    # DeepSeek-V3's multi-latent attention (model/latent_attention.py), Megatron-LM's flags and defaults.
    multi_latent_attention: bool = opt(
        False,
        "Multi-latent attention: queries (optionally) and keys/values projected through low-rank "
        "latents, plus a decoupled rotary part of each query head and one rotary key shared by all heads.",
    )
    q_lora_rank: Optional[int] = opt(
        None, "MLA: rank of the query latent; unset: queries projected directly from the hidden state."
    )
    kv_lora_rank: int = opt(32, "MLA: rank of the key/value latent.")
    qk_head_dim: int = opt(128, "MLA: query/key dimensions per head without rotary embedding.")
    qk_pos_emb_head_dim: int = opt(64, "MLA: query/key dimensions per head with rotary embedding (YaRN).")
    v_head_dim: int = opt(128, "MLA: value dimensions per head.")
    rotary_scaling_factor: float = opt(1.0, "YaRN's context extension factor (1: plain rotary).")
    mscale: float = opt(
        1.0, "YaRN's mscale (the rotary tables are scaled by mscale(factor, mscale) / mscale-all-dim's)."
    )
    mscale_all_dim: float = opt(
        0.0, "YaRN's mscale_all_dim (MLA: also scales the softmax by its square, as DeepSeek-V3)."
    )
    softmax_scale: Optional[float] = opt(
        None,
        "Attention scores are q.k times this (megatron-core's TransformerConfig.softmax_scale, "
        "which Megatron-LM sets from no flag; Granite's attention_multiplier). Unset: 1/sqrt(head dimension).",
    )
    embedding_multiplier: float = opt(
        1.0, "The word embeddings are multiplied by this (Granite's embedding_multiplier; no Megatron-LM flag)."
    )
    residual_multiplier: float = opt(
        1.0,
        "The attention and MLP outputs are multiplied by this before each residual add "
        "(Granite's residual_multiplier; no Megatron-LM flag).",
    )
    logits_scaling: float = opt(
        1.0, "The output logits are divided by this (Granite's logits_scaling; no Megatron-LM flag)."
    )
    seq_length: int = opt(256, "Sequence length of a training sample.")
    max_position_embeddings: Optional[int] = opt(None, "Learned positions table size (default seq-length).")
    vocab_size: Optional[int] = opt(
        None, "Vocabulary size before padding (set by the tokenizer; needed with --mock-data)."
    )
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this (must be divisible by TP).")
    normalization: str = opt("LayerNorm", "Normalisation layer.", choices=["LayerNorm", "RMSNorm"])
    layer_norms: str = opt(
        "input",
        "Where each layer's norms sit: on the inputs of attention and the MLP ('input', pre-norm, "
        "Megatron-LM's), on their outputs before each residual add ('output', OLMo 2), or both "
        "('both'). No Megatron-LM flag.",
        choices=["input", "output", "both"],
    )
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalisation layers.")
    swiglu: bool = opt(False, "Use SwiGLU in the MLP instead of GELU.")
    bias_gelu_fusion: bool = opt(
        True,
        "Megatron-LM's fused bias+GELU, which computes GELU's tanh approximation: a "
        "GELU MLP with biases computes tanh GELU unless --no-bias-gelu-fusion (then "
        "exact erf GELU, as without biases).",
    )
    quick_geglu: bool = opt(False, "Gated MLP with quick-GELU, x * sigmoid(1.702 x), on the gate (gpt-oss).")
    geglu: bool = opt(
        False,
        "Gated MLP with GELU's tanh approximation on the gate, gelu_tanh(gate) * up (Gemma's "
        "gelu_pytorch_tanh; megatron-core's gated_linear_unit with a tanh GELU). No Megatron-LM flag.",
    )
    glu_linear_offset: float = opt(0.0, "Gated MLPs compute act(gate) * (up + offset) (gpt-oss: 1).")
    activation_func_clamp_value: Optional[float] = opt(
        None,
        "Gated MLPs clamp the gate to at most C and the linear half to [-C, C] before the activation (gpt-oss: 7).",
    )
    position_embedding_type: str = opt("learned_absolute", "Position encoding.", choices=["learned_absolute", "rope"])
    rotary_base: float = opt(10000.0, "Base of the rotary embedding frequencies.")
    rotary_base_local: Optional[float] = opt(
        None,
        "Base of the rotary frequencies of the sliding-window layers (Gemma 3's local base, "
        "rope_parameters.sliding_attention.rope_theta), whose rotary is then unscaled: "
        "--use-rope-scaling and --rotary-seq-len-interpolation-factor scale the other layers' "
        "(Gemma 3's full layers, linearly by 8). Unset: --rotary-base for every layer. No Megatron-LM flag.",
    )
    rotary_percent: float = opt(
        1.0, "Fraction of each head's dimensions that rotary embeddings rotate (the rest pass through unchanged)."
    )
    use_rope_scaling: bool = opt(
        False,
        "Llama 3.1's rotary frequency scaling, as Megatron-LM computes it: low/high "
        "frequency factors 1 and 4 over an original context of 8192, --rope-scaling-factor.",
    )
    rope_scaling_factor: float = opt(8.0, "The factor of --use-rope-scaling.")
    rotary_seq_len_interpolation_factor: Optional[int] = opt(
        None, "Linear position interpolation: rotary positions are divided by it (Megatron-LM's type: an integer)."
    )
    rope_type: Optional[str] = opt(
        None,
        "Rotary kind: rope, or yarn (YaRN: --rotary-scaling-factor, --mscale, --mscale-all-dim and the "
        "--yarn-* options); unset: yarn under --multi-latent-attention, rope otherwise (Megatron-LM's defaults).",
        choices=["rope", "yarn"],
    )
    # megatron-core's TransformerConfig.yarn_* fields (no Megatron-LM flags): standard attention's YaRN only
    yarn_original_max_position_embeddings: int = opt(4096, "YaRN (standard attention): the original context.")
    yarn_beta_fast: float = opt(32.0, "YaRN (standard attention): rotations bounding the kept fast dimensions.")
    yarn_beta_slow: float = opt(1.0, "YaRN (standard attention): rotations bounding the interpolated slow ones.")
    yarn_correction_range_round_to_int: bool = opt(
        True, "YaRN (standard attention): round the blend's range to whole dimensions (gpt-oss: not)."
    )
    untie_embeddings_and_output_weights: bool = opt(
        False, "Use a separate output matrix instead of the input embedding."
    )
    disable_bias_linear: bool = opt(False, "No biases in linear layers.")
    hidden_dropout: float = opt(0.1, "Dropout on the residual branches.")
    attention_dropout: float = opt(0.1, "Dropout on attention probabilities.")
    init_method_std: float = opt(
        0.02, "Std of the normal initialisation (output projections are scaled by 1/sqrt(2L))."
    )
    # Mixture of experts.
    num_experts: Optional[int] = opt(None, "Number of experts E (MoE MLP); unset or 0 means dense.")
    moe_layer_freq: LayerPattern = opt(
        1,
        "Which layers are MoE: N puts one at layers 0, N, 2N, ... (1: every layer); or one 0/1 a "
        "layer as a list expression, e.g. '([0]*3+[1]*58)' (DeepSeek-V3's 3 dense first layers).",
    )
    moe_router_topk: int = opt(2, "Experts per token (top-1 Switch, top-2 GShard).")
    moe_router_pre_softmax: bool = opt(
        False,
        "Softmax over all experts, then top-k: the weights are the router "
        "probabilities (Switch, M6; needed for top-1). Unset: top-k of the logits, "
        "then softmax over the k, so the weights sum to 1 (Mixtral).",
    )
    moe_ffn_hidden_size: Optional[int] = opt(None, "Expert FFN hidden size (default ffn-hidden-size).")
    moe_num_prototypes: int = opt(1, "Expert prototyping (M6-T): K groups, top-1 in each, outputs summed.")
    moe_router_score_function: str = opt(
        "softmax",
        "Router scores: softmax over the experts, or sigmoid per expert (DeepSeek-V3; the k chosen "
        "scores are normalised to sum 1).",
        choices=["softmax", "sigmoid"],
    )
    moe_router_topk_scaling_factor: Optional[float] = opt(
        None, "Multiply the top-k combine weights by this (DeepSeek-V3: 2.5); unset: no scaling."
    )
    moe_router_num_groups: Optional[int] = opt(
        None, "Group-limited routing: the experts form this many groups of consecutive experts."
    )
    moe_router_group_topk: Optional[int] = opt(
        None,
        "Group-limited routing: each token chooses its experts within this many groups, those with "
        "the largest sums of their top-(topk/group-topk) scores; unset: no group limit.",
    )
    moe_router_enable_expert_bias: bool = opt(
        False,
        "Auxiliary-loss-free balancing: a per-expert bias added to the sigmoid scores to choose the "
        "experts (never to their weights), moved after each step by --moe-router-bias-update-rate "
        "towards balance by the sign of each expert's load error.",
    )
    moe_router_bias: bool = opt(
        True,
        "With the linear layers' biases, a learned bias on the router's logits (megatron-core's Router "
        "under --add-bias-linear, gpt-oss's); --no-moe-router-bias leaves it out, as in checkpoints "
        "written before it existed here (they load so).",
    )
    moe_router_bias_update_rate: float = opt(1e-3, "Step of the expert bias update (DeepSeek-V3: 1e-3).")
    moe_router_load_balancing_type: str = opt(
        "aux_loss",
        "Load-balancing loss weighted by --moe-aux-loss-coeff: aux_loss (Switch, over the "
        "micro-batch), seq_aux_loss (DeepSeek: per sequence, averaged) or none.",
        choices=["aux_loss", "seq_aux_loss", "none"],
    )
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None,
        "Shared experts: an always-on MLP of this FFN size (all shared experts together) beside "
        "the routed experts, TP-split like the dense MLP; unset: none.",
    )
    moe_shared_expert_gate: bool = opt(False, "Scale the shared experts' output by sigmoid(w . x), w learned [1, h].")
    moe_shared_expert_overlap: bool = opt(
        False,
        "Compute the shared experts while the routed rows' dispatch all-to-all is in flight (EP > 1; "
        "otherwise there is nothing to overlap with).",
    )
    moe_aux_loss_coeff: float = opt(0.0, "Load-balancing loss coefficient (Switch formulation).")
    moe_z_loss_coeff: float = opt(0.0, "Router z-loss coefficient.")
    moe_capacity_factor: Optional[float] = opt(
        None,
        "Expert capacity factor, also spelled --moe-expert-capacity-factor (Megatron-LM's name): an expert "
        "takes at most ceil(tokens * slots / experts * factor) of a micro-batch's assignments; unset: dropless.",
    )
    moe_token_drop_policy: str = opt(
        "probs",
        "Which assignments an expert over capacity keeps: probs, those of the highest router "
        "probabilities; position, those of the earliest tokens.",
        choices=["probs", "position"],
    )
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "Pad every expert's rows to its capacity with zero rows: fixed shapes, the same math (docs/moe.md)."
    )
    moe_input_jitter_eps: Optional[float] = opt(None, "Multiplicative router input jitter (training only).")
    # Multi-token prediction (DeepSeek-V3; docs/mtp.md).
    mtp_num_layers: Optional[int] = opt(
        None, "Multi-token prediction depths: depth k predicts the token k+1 ahead (unset: none)."
    )
    mtp_loss_scaling_factor: float = opt(0.1, "Weight of the mean of the MTP depths' losses in the objective.")
    moe_grouped_gemm: bool = opt(
        False,
        "Experts through torch's grouped_mm, one jagged group of rows per expert, "
        "no padded rows (where the device and dtype support it; else padded bmm, logged).",
    )

    @property
    def moe_slots(self) -> int:
        """Assignments per token: top-k, or one per prototype group."""
        return self.moe_num_prototypes if self.moe_num_prototypes > 1 else self.moe_router_topk

    def expert_capacity(self, tokens: int) -> Optional[int]:
        """Assignments one expert keeps of ``tokens`` tokens (megatron-core's ``get_capacity``, in
        its order of operations); None is dropless."""
        if self.moe_capacity_factor is None:
            return None
        return math.ceil((tokens * self.moe_slots / self.num_experts) * self.moe_capacity_factor)

    def padded_expert_rows(self, tokens: int) -> Optional[int]:
        """Rows every expert gets with --moe-pad-expert-input-to-capacity: its capacity, but at
        most every token (a token goes to an expert once; megatron-core's mask keeps them all)."""
        if not self.moe_pad_expert_input_to_capacity:
            return None
        return min(self.expert_capacity(tokens), tokens)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def shared_expert_ffn_size(self) -> int:
        """FFN size of the shared experts (0: none)."""
        return self.moe_shared_expert_intermediate_size or 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups under --group-query-attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that rotary embeddings rotate (Megatron-LM's rounding)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def q_head_dim(self) -> int:
        """MLA: query/key dimensions per head, the rotary part last."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def input_norms(self) -> bool:
        """Norms on the inputs of attention and the MLP (``input_norm``, ``post_attention_norm``)."""
        return self.layer_norms != "output"

    @property
    def output_norms(self) -> bool:
        """Norms on the outputs of attention and the MLP (``attention_output_norm``, ``mlp_output_norm``)."""
        return self.layer_norms != "input"

    @property
    def qk_norm(self) -> Optional[str]:
        """The query/key heads' norm: "L2" (--qk-l2-norm), --normalization's (--qk-layernorm) or None."""
        if self.qk_l2_norm:
            return "L2"
        return self.normalization if self.qk_layernorm else None

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias or self.add_qkv_bias

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 has a gate and a linear half (rows interleaved as (gate_j, up_j)): SwiGLU, GeGLU or quick-GeGLU."""
        return self.swiglu or self.geglu or self.quick_geglu

    def __hash__(self) -> int:
        """Hashable with a per-layer list field (--moe-layer-freq '([0]*3+[1]*58)'), as caches keyed by the model's
        shape need; equal configs hash alike (dataclass's own __hash__ would raise on the list)."""
        return hash(tuple(tuple(v) if isinstance(v, list) else v for v in vars(self).values()))

    def attention_window(self, layer: int) -> Optional[int]:
        """Keys before the query that layer ``layer`` (from 0) attends to; None: all of them.
        Megatron-LM's rule (``is_layer_window_attention``, layers counted from 1 there)."""
        if self.window_size is None:
            return None
        freq = self.window_attn_skip_freq
        if isinstance(freq, list) and not freq[layer] or isinstance(freq, int) and (layer + 1) % freq == 0:
            return None
        return _window(self.window_size)[0]

    @property
    def add_bias(self) -> bool:
        return not self.disable_bias_linear

    @property
    def gelu_approximation(self) -> str:
        """``approximate`` of the MLP's (and experts') GELU. Megatron-LM adds fc1's bias in its fused
        ``bias_gelu`` kernel, the tanh formula, whenever it can (biases, GELU, --bias-gelu-fusion);
        otherwise it calls exact ``F.gelu``. ``--openai-gelu`` is not read by megatron-core."""
        return "tanh" if self.add_bias and self.bias_gelu_fusion and not self.gated_linear_unit else "none"

    def is_moe_layer(self, layer: int) -> bool:
        """Megatron-LM's ``moe_layer_freq`` rule (``gpt_layer_specs``): layers 0, N, 2N, ... or the list's 1s."""
        return bool(self.num_experts) and expand_layer_pattern(self.moe_layer_freq, layer + 1)[layer] == 1

    @property
    def expert_bias(self) -> bool:
        """Routers keep an expert bias: --moe-router-enable-expert-bias with experts (without, the flag has nothing to bias)."""
        return bool(self.num_experts) and self.moe_router_enable_expert_bias

    @property
    def all_layers_moe(self) -> bool:
        return all(self.is_moe_layer(layer) for layer in range(self.num_layers))

    @property
    def padded_vocab_size(self) -> int:
        """Independent of TP (unlike Megatron's multiple-of-divisor-x-TP), so every layout
        has the same embedding shape and checkpoints reshard without re-padding."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def check(self) -> None:
        """The rules between the model's fields (each field's range: ``RANGES``; the parallel split:
        ``check_split``)."""
        self._check_attention()
        if self.multi_latent_attention:
            self._check_latent_attention()
        if self.max_positions < self.seq_length:
            raise ConfigError(
                f"--max-position-embeddings ({self.max_positions}) must be >= --seq-length ({self.seq_length})"
            )
        if self.num_experts:
            self._check_experts()
        self._check_activation()

    def _check_activation(self) -> None:
        given = [
            flag
            for flag, on in (("--swiglu", self.swiglu), ("--geglu", self.geglu), ("--quick-geglu", self.quick_geglu))
            if on
        ]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)} are {('two', 'three')[len(given) - 2]} activations: give one")
        for flag, given in (
            ("--glu-linear-offset", self.glu_linear_offset != 0.0),
            ("--activation-func-clamp-value", self.activation_func_clamp_value is not None),
        ):
            if given and not self.gated_linear_unit:
                raise ConfigError(f"{flag} applies to a gated MLP: add --swiglu, --geglu or --quick-geglu")

    def _check_attention(self) -> None:
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size ({self.hidden_size}) must be divisible by "
                f"--num-attention-heads ({self.num_attention_heads}) (or set --kv-channels)"
            )
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})"
            )
        if self.qk_layernorm_over_heads and not (self.qk_layernorm and self.normalization == "RMSNorm"):
            raise ConfigError("--qk-layernorm-over-heads needs --qk-layernorm and --normalization RMSNorm")
        if self.qk_l2_norm and self.qk_layernorm:
            raise ConfigError(
                "--qk-l2-norm and --qk-layernorm are two query/key norms: give one (megatron-core builds "
                "only the L2 norm when both are given, and the --qk-layernorm weights are then not there)"
            )
        if isinstance(self.window_attn_skip_freq, list) and len(self.window_attn_skip_freq) != self.num_layers:
            raise ConfigError(
                f"--window-attn-skip-freq lists {len(self.window_attn_skip_freq)} layers, expected one 0/1 "
                f"for each of the {self.num_layers} layers (--num-layers)"
            )
        if self.window_size is not None:
            _window(self.window_size)
        elif self.window_attn_skip_freq is not None:
            raise ConfigError("--window-attn-skip-freq needs --window-size")
        self._check_gemma_attention()
        scaled = [
            flag
            for flag, on in (
                ("--use-rope-scaling", self.use_rope_scaling),
                ("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor is not None),
            )
            if on
        ]
        if self.yarn:
            self._check_yarn(scaled)
        elif self._yarn_options_set() and not self.multi_latent_attention:
            raise ConfigError(f"{self._yarn_options_set()[0]} configures YaRN: it needs --rope-type yarn")
        if scaled and self.position_embedding_type != "rope":
            raise ConfigError(f"{scaled[0]} scales rotary embeddings: it needs --position-embedding-type rope")
        if (
            self.position_embedding_type == "rope"
            and not self.multi_latent_attention
            and (self.rotary_dim % 2 or not self.rotary_dim)
        ):
            raise ConfigError(
                f"rotary embeddings need an even, non-zero number of rotated dimensions: "
                f"--rotary-percent {self.rotary_percent} of head dimension {self.head_dim} "
                f"gives {self.rotary_dim}"
            )

    def _check_gemma_attention(self) -> None:
        """Soft-capping runs in our own attention core (model/attention.py): what it is not built with;
        a local rotary base needs rotary windowed layers to apply to."""
        if self.attn_logit_softcapping is not None and self.softmax_type != "vanilla":
            raise ConfigError(
                "--attn-logit-softcapping with --softmax-type: the soft-capped core has no attention sinks"
            )
        if self.rotary_base_local is not None and (self.window_size is None or self.position_embedding_type != "rope"):
            raise ConfigError(
                "--rotary-base-local is the rotary base of the sliding-window layers: it needs --window-size "
                "and --position-embedding-type rope"
            )

    @property
    def router_bias(self) -> bool:
        """The router has a learned bias (moe/router.py): megatron-core's under --add-bias-linear."""
        return self.add_bias and self.moe_router_bias

    @property
    def rotary_type(self) -> str:
        """--rope-type with Megatron-LM's default when unset: yarn under MLA, rope otherwise."""
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    @property
    def yarn(self) -> bool:
        """Standard attention's rotary tables are YaRN's (MLA's always are: model/latent_attention.py)."""
        return self.rotary_type == "yarn" and not self.multi_latent_attention

    def _yarn_options_set(self) -> List[str]:
        """The --yarn-* options given other values than their defaults (standard attention's YaRN only)."""
        fields = type(self).__dataclass_fields__
        return [
            ("--no-" if f.endswith("int") else "--") + f.replace("_", "-")
            for f in _YARN_FIELDS
            if getattr(self, f) != fields[f].default
        ]

    def _check_yarn(self, scaled) -> None:
        """What standard attention's YaRN (megatron-core's YarnRotaryEmbedding) does not combine with."""
        if self.position_embedding_type != "rope":
            raise ConfigError("--rope-type yarn scales rotary embeddings: it needs --position-embedding-type rope")
        if scaled or self.rotary_percent != 1.0:
            flag = scaled[0] if scaled else f"--rotary-percent {self.rotary_percent}"
            raise ConfigError(f"--rope-type yarn with {flag}: YaRN's tables rotate whole heads, alone")

    def _check_latent_attention(self) -> None:
        """What multi-latent attention (Megatron-LM's MLASelfAttention) does not combine with."""
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(
                f"--qk-pos-emb-head-dim ({self.qk_pos_emb_head_dim}) must be even: rotary embeddings rotate pairs"
            )
        yarn_set = self._yarn_options_set()
        unbuilt = [
            (
                yarn_set[0] if yarn_set else "",
                bool(yarn_set),
                "megatron-core's MLA fixes YaRN's original context at 4096 and betas at 32, 1, rounded",
            ),
            (
                "--rope-type rope",
                self.rope_type == "rope" and self.rotary_scaling_factor != 1.0,
                f"--rotary-scaling-factor {self.rotary_scaling_factor} needs YaRN (rope is built with factor 1)",
            ),
            ("--group-query-attention", self.group_query_attention, "mutually exclusive, as in Megatron-LM"),
            ("--softmax-type", self.softmax_type != "vanilla", "attention sinks are built for standard attention"),
            ("--window-size", self.window_size is not None, "sliding windows are built for standard attention"),
            (
                "--attn-logit-softcapping",
                self.attn_logit_softcapping is not None,
                "soft-capping is built for standard attention",
            ),
            ("--add-qkv-bias", self.add_qkv_bias, "MLA's projections have no bias, as in Megatron-LM"),
            ("--use-rope-scaling", self.use_rope_scaling, "MLA's rotary part scales with YaRN"),
            (
                "--rotary-seq-len-interpolation-factor",
                self.rotary_seq_len_interpolation_factor is not None,
                "MLA's rotary part scales with YaRN",
            ),
        ]
        for flag, given, why in unbuilt:
            if given:
                raise ConfigError(f"{flag} is refused with --multi-latent-attention: {why}")

    def _check_experts(self) -> None:
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != self.num_layers:
            raise ConfigError(
                f"--moe-layer-freq lists {len(self.moe_layer_freq)} layers, expected one 0/1 for each of "
                f"the {self.num_layers} layers (--num-layers)"
            )
        if self.num_experts % self.moe_num_prototypes:
            raise ConfigError(
                f"--num-experts ({self.num_experts}) must be divisible by "
                f"--moe-num-prototypes ({self.moe_num_prototypes})"
            )
        if self.moe_pad_expert_input_to_capacity and self.moe_capacity_factor is None:
            raise ConfigError(
                "--moe-pad-expert-input-to-capacity pads to a capacity: it needs --moe-expert-capacity-factor"
            )
        if self.moe_num_prototypes > 1 and self.moe_router_topk != 1:
            raise ConfigError(
                "expert prototyping (--moe-num-prototypes > 1) takes top-1 in each group: "
                f"--moe-router-topk must be 1, got {self.moe_router_topk}"
            )
        if (
            self.moe_router_topk == 1
            and not self.moe_router_pre_softmax
            and self.moe_router_score_function == "softmax"
        ):
            raise ConfigError(
                "top-1 routing needs --moe-router-pre-softmax (a softmax over one selected logit is 1: "
                "the router would get no gradient), as in Megatron-LM"
            )
        per_group = self.num_experts // self.moe_num_prototypes
        if not 1 <= self.moe_router_topk <= per_group:
            raise ConfigError(
                f"--moe-router-topk ({self.moe_router_topk}) must be between 1 and --num-experts ({per_group})"
            )
        self._check_deepseek_routing()

    def _check_deepseek_routing(self) -> None:
        """Sigmoid scores, group-limited top-k, the expert bias, the per-sequence loss and the shared
        experts: Megatron-LM's rules, and what is not built with expert prototyping."""
        given = [
            flag
            for flag, on in (
                ("--moe-router-score-function sigmoid", self.moe_router_score_function == "sigmoid"),
                ("--moe-router-group-topk", self.moe_router_group_topk is not None),
                (
                    "--moe-router-load-balancing-type seq_aux_loss",
                    self.moe_router_load_balancing_type == "seq_aux_loss",
                ),
                ("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor is not None),
            )
            if on
        ]
        if given and self.moe_num_prototypes > 1:
            raise ConfigError(f"{given[0]} is top-k routing: it does not combine with --moe-num-prototypes")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ConfigError(
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron-LM)"
            )
        if self.moe_router_group_topk is not None:
            self._check_groups()
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias:
            raise ConfigError(
                "--moe-shared-expert-intermediate-size: shared experts have no biases (as in Megatron-LM): "
                "add --disable-bias-linear"
            )

    def _check_groups(self) -> None:
        groups, chosen, k = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        if groups is None:
            raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups (as in Megatron-LM)")
        if self.num_experts % groups:
            raise ConfigError(
                f"--num-experts ({self.num_experts}) must be divisible by --moe-router-num-groups ({groups})"
            )
        if chosen > groups:
            raise ConfigError(f"--moe-router-group-topk ({chosen}) must be at most --moe-router-num-groups ({groups})")
        if k < chosen or k > chosen * (self.num_experts // groups):
            raise ConfigError(
                f"--moe-router-topk ({k}) must be between --moe-router-group-topk ({chosen}) (each chosen group "
                f"is scored by its top-(topk/group-topk) experts) and the experts of the chosen groups "
                f"({chosen * (self.num_experts // groups)})"
            )

    def check_split(self, tp: int, ep: int) -> None:
        """Every matrix TP splits, and the experts EP spreads, divide evenly."""
        sizes = [("--num-attention-heads", self.num_attention_heads), ("--ffn-hidden-size", self.ffn_size)]
        if self.num_experts:
            sizes.append(("--moe-ffn-hidden-size", self.expert_ffn_size))
            if self.shared_expert_ffn_size:
                sizes.append(("--moe-shared-expert-intermediate-size", self.shared_expert_ffn_size))
        for name, size in sizes:
            if size % tp:
                raise ConfigError(f"{name} ({size}) must be divisible by --tensor-model-parallel-size ({tp})")
        groups = self.query_groups
        if groups % tp and tp % groups:
            raise ConfigError(
                f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide "
                "one another (TP splits the key/value heads, or replicates each over TP/groups ranks)"
            )
        if self.make_vocab_size_divisible_by % tp:
            raise ConfigError(
                f"--make-vocab-size-divisible-by ({self.make_vocab_size_divisible_by}) must be "
                f"divisible by --tensor-model-parallel-size ({tp}) so the padded vocabulary splits evenly"
            )
        if self.num_experts and self.num_experts % ep:
            raise ConfigError(
                f"--num-experts ({self.num_experts}) must be divisible by --expert-model-parallel-size ({ep})"
            )
        if not self.num_experts and ep > 1:
            raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")


def _window(text: str) -> tuple:
    """(left, right) of --window-size "L,R" (or "(L,R)"), Megatron-LM's form; the model is causal, so R is 0."""
    try:
        left, right = (int(part) for part in text.strip().strip("()").split(","))
    except ValueError:
        raise ConfigError(f"--window-size must be two integers 'L,0' (L keys before the query), got {text!r}") from None
    if left < 0 or right != 0:
        raise ConfigError(f"--window-size {text}: a causal model takes 'L,0' with L >= 0 (no keys after the query)")
    return left, right


# Type and range of every numeric field (config/ranges.py); the rules between fields are in ``check``.
_YARN_FIELDS = (
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
)
RANGES = {
    "num_layers": at_least(1, LAYERS),
    "hidden_size": at_least(1, 2**18),
    "ffn_hidden_size": at_least(1, 2**20),
    "num_attention_heads": at_least(1, LAYERS),
    "num_query_groups": at_least(1, LAYERS),
    "kv_channels": at_least(1, 2**18),
    "seq_length": at_least(1, 2**24),
    "max_position_embeddings": at_least(1, 2**24),
    "vocab_size": at_least(2, 2**31 - 1),
    "make_vocab_size_divisible_by": at_least(1, 2**16),
    "norm_epsilon": positive(1.0),
    "rotary_base": positive(),
    "rotary_base_local": positive(),
    "attn_logit_softcapping": positive(),
    "final_logit_softcapping": positive(),
    "rotary_percent": Range(0.0, 1.0, low_open=True),
    "rope_scaling_factor": positive(),
    "rotary_seq_len_interpolation_factor": positive(),
    "hidden_dropout": fraction(),
    "attention_dropout": fraction(),
    "init_method_std": positive(),
    "num_experts": at_least(0, 2**16),
    "moe_router_topk": at_least(1, 2**16),
    "moe_ffn_hidden_size": at_least(1, 2**20),
    "moe_num_prototypes": at_least(1, 2**16),
    "moe_aux_loss_coeff": Range(0.0),
    "moe_router_topk_scaling_factor": positive(),
    "moe_router_num_groups": at_least(1, 2**16),
    "moe_router_group_topk": at_least(1, 2**16),
    "moe_router_bias_update_rate": Range(0.0),
    "moe_shared_expert_intermediate_size": at_least(1, 2**20),
    "moe_z_loss_coeff": Range(0.0),
    "moe_capacity_factor": positive(),
    "moe_input_jitter_eps": fraction(),
    "mtp_num_layers": at_least(1, LAYERS),
    "mtp_loss_scaling_factor": Range(0.0),
    "glu_linear_offset": Range(-1e6, 1e6),
    "q_lora_rank": at_least(1, 2**18),
    "kv_lora_rank": at_least(1, 2**18),
    "qk_head_dim": at_least(1, 2**16),
    "qk_pos_emb_head_dim": at_least(2, 2**16),
    "v_head_dim": at_least(1, 2**16),
    "rotary_scaling_factor": positive(),
    "mscale": Range(0.0, 1e6),
    "mscale_all_dim": Range(0.0, 1e6),
    "yarn_original_max_position_embeddings": at_least(1, 2**24),
    "yarn_beta_fast": positive(),
    "yarn_beta_slow": positive(),
    "activation_func_clamp_value": positive(),
    "softmax_scale": positive(),
    "embedding_multiplier": positive(),
    "residual_multiplier": positive(),
    "logits_scaling": positive(),
}
