"""The model section: the transformer's shape, MoE and the rules that need nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import ConfigError, opt
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
    add_qkv_bias: bool = opt(False, "Bias in the query/key/value projection even with --disable-bias-linear (Qwen2).")
    window_size: Optional[str] = opt(
        None,
        "Sliding-window attention 'L,0': a query sees itself and the L keys before "
        "it (Megatron-LM's form; Hugging Face's sliding_window is L+1). Unset: full "
        "causal attention.",
    )
    window_attn_skip_freq: Optional[int] = opt(
        None,
        "With --window-size, every N-th layer (layers N-1, 2N-1, ... "
        "counting from 0) has full attention; unset: every layer is windowed.",
    )
    softmax_type: str = opt(
        "vanilla",
        "Attention softmax: 'off-by-one' adds exp(0) to each denominator, 'learnable' "
        "exp(a_h) with a learned logit a_h per head (attention sinks, gpt-oss).",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    seq_length: int = opt(256, "Sequence length of a training sample.")
    max_position_embeddings: Optional[int] = opt(None, "Learned positions table size (default seq-length).")
    vocab_size: Optional[int] = opt(
        None, "Vocabulary size before padding (set by the tokenizer; needed with --mock-data)."
    )
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this (must be divisible by TP).")
    normalization: str = opt("LayerNorm", "Normalisation layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalisation layers.")
    swiglu: bool = opt(False, "Use SwiGLU in the MLP instead of GELU.")
    bias_gelu_fusion: bool = opt(
        True,
        "Megatron-LM's fused bias+GELU, which computes GELU's tanh approximation: a "
        "GELU MLP with biases computes tanh GELU unless --no-bias-gelu-fusion (then "
        "exact erf GELU, as without biases).",
    )
    quick_geglu: bool = opt(False, "Gated MLP with quick-GELU, x * sigmoid(1.702 x), on the gate (gpt-oss).")
    glu_linear_offset: float = opt(0.0, "Gated MLPs compute act(gate) * (up + offset) (gpt-oss: 1).")
    activation_func_clamp_value: Optional[float] = opt(
        None,
        "Gated MLPs clamp the gate to at most C and the linear half to [-C, C] before the activation (gpt-oss: 7).",
    )
    position_embedding_type: str = opt("learned_absolute", "Position encoding.", choices=["learned_absolute", "rope"])
    rotary_base: float = opt(10000.0, "Base of the rotary embedding frequencies.")
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
    moe_layer_freq: int = opt(1, "Every k-th layer is MoE (layers k-1, 2k-1, ...; 1 means all).")
    moe_router_topk: int = opt(2, "Experts per token (top-1 Switch, top-2 GShard).")
    moe_router_pre_softmax: bool = opt(
        False,
        "Softmax over all experts, then top-k: the weights are the router "
        "probabilities (Switch, M6; needed for top-1). Unset: top-k of the logits, "
        "then softmax over the k, so the weights sum to 1 (Mixtral).",
    )
    moe_ffn_hidden_size: Optional[int] = opt(None, "Expert FFN hidden size (default ffn-hidden-size).")
    moe_num_prototypes: int = opt(1, "Expert prototyping (M6-T): K groups, top-1 in each, outputs summed.")
    moe_aux_loss_coeff: float = opt(0.0, "Load-balancing loss coefficient (Switch formulation).")
    moe_z_loss_coeff: float = opt(0.0, "Router z-loss coefficient.")
    moe_capacity_factor: Optional[float] = opt(None, "Expert capacity factor; unset means dropless.")
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
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

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
    def qkv_bias(self) -> bool:
        return self.add_bias or self.add_qkv_bias

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 has a gate and a linear half (rows interleaved as (gate_j, up_j)): SwiGLU or quick-GeGLU."""
        return self.swiglu or self.quick_geglu

    def attention_window(self, layer: int) -> Optional[int]:
        """Keys before the query that layer ``layer`` (from 0) attends to; None: all of them.
        Megatron-LM's rule (``is_layer_window_attention``, layers counted from 1 there)."""
        if self.window_size is None:
            return None
        if self.window_attn_skip_freq and (layer + 1) % self.window_attn_skip_freq == 0:
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
        return bool(self.num_experts) and (layer + 1) % self.moe_layer_freq == 0

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
        if self.max_positions < self.seq_length:
            raise ConfigError(
                f"--max-position-embeddings ({self.max_positions}) must be >= --seq-length ({self.seq_length})"
            )
        if self.num_experts:
            self._check_experts()
        self._check_activation()

    def _check_activation(self) -> None:
        if self.swiglu and self.quick_geglu:
            raise ConfigError("--swiglu and --quick-geglu are two activations: give one")
        for flag, given in (
            ("--glu-linear-offset", self.glu_linear_offset != 0.0),
            ("--activation-func-clamp-value", self.activation_func_clamp_value is not None),
        ):
            if given and not self.gated_linear_unit:
                raise ConfigError(f"{flag} applies to a gated MLP: add --swiglu or --quick-geglu")

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
        if self.window_size is not None:
            _window(self.window_size)
        elif self.window_attn_skip_freq is not None:
            raise ConfigError("--window-attn-skip-freq needs --window-size")
        scaled = [
            flag
            for flag, on in (
                ("--use-rope-scaling", self.use_rope_scaling),
                ("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor is not None),
            )
            if on
        ]
        if scaled and self.position_embedding_type != "rope":
            raise ConfigError(f"{scaled[0]} scales rotary embeddings: it needs --position-embedding-type rope")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 or not self.rotary_dim):
            raise ConfigError(
                f"rotary embeddings need an even, non-zero number of rotated dimensions: "
                f"--rotary-percent {self.rotary_percent} of head dimension {self.head_dim} "
                f"gives {self.rotary_dim}"
            )

    def _check_experts(self) -> None:
        if self.num_experts % self.moe_num_prototypes:
            raise ConfigError(
                f"--num-experts ({self.num_experts}) must be divisible by "
                f"--moe-num-prototypes ({self.moe_num_prototypes})"
            )
        if self.moe_num_prototypes > 1 and self.moe_router_topk != 1:
            raise ConfigError(
                "expert prototyping (--moe-num-prototypes > 1) takes top-1 in each group: "
                f"--moe-router-topk must be 1, got {self.moe_router_topk}"
            )
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            raise ConfigError(
                "top-1 routing needs --moe-router-pre-softmax (a softmax over one selected logit is 1: "
                "the router would get no gradient), as in Megatron-LM"
            )
        per_group = self.num_experts // self.moe_num_prototypes
        if not 1 <= self.moe_router_topk <= per_group:
            raise ConfigError(
                f"--moe-router-topk ({self.moe_router_topk}) must be between 1 and --num-experts ({per_group})"
            )

    def check_split(self, tp: int, ep: int) -> None:
        """Every matrix TP splits, and the experts EP spreads, divide evenly."""
        sizes = [("--num-attention-heads", self.num_attention_heads), ("--ffn-hidden-size", self.ffn_size)]
        if self.num_experts:
            sizes.append(("--moe-ffn-hidden-size", self.expert_ffn_size))
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
    "rotary_percent": Range(0.0, 1.0, low_open=True),
    "rope_scaling_factor": positive(),
    "rotary_seq_len_interpolation_factor": positive(),
    "hidden_dropout": fraction(),
    "attention_dropout": fraction(),
    "init_method_std": positive(),
    "num_experts": at_least(0, 2**16),
    "moe_layer_freq": at_least(1, LAYERS),
    "moe_router_topk": at_least(1, 2**16),
    "moe_ffn_hidden_size": at_least(1, 2**20),
    "moe_num_prototypes": at_least(1, 2**16),
    "moe_aux_loss_coeff": Range(0.0),
    "moe_z_loss_coeff": Range(0.0),
    "moe_capacity_factor": positive(),
    "moe_input_jitter_eps": fraction(),
    "window_attn_skip_freq": at_least(1, LAYERS),
    "mtp_num_layers": at_least(1, LAYERS),
    "mtp_loss_scaling_factor": Range(0.0),
    "glu_linear_offset": Range(-1e6, 1e6),
    "activation_func_clamp_value": positive(),
}
