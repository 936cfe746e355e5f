"""Configuration as plain dataclasses.

Every field is also a Megatron-style command-line flag: the field ``num_layers`` is the flag
``--num-layers`` and the YAML key ``num-layers`` (or ``num_layers``). ``arguments.py`` builds
the parser from these fields, so a new option is added in exactly one place.

``validate`` holds every cross-field rule, each failing with one specific message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional


def opt(default, help: str, **kwargs):
    """A dataclass field that is also a CLI flag (``choices``, ``nargs`` go to argparse)."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ModelConfig:
    num_layers: int = opt(4, "Number of transformer layers L.")
    hidden_size: int = opt(256, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = opt(None, "Dense MLP hidden size (default 4*hidden).")
    num_attention_heads: int = opt(4, "Number of attention heads.")
    seq_length: int = opt(256, "Sequence length of a training sample.")
    max_position_embeddings: Optional[int] = opt(None, "Learned positions table size (default seq-length).")
    vocab_size: Optional[int] = opt(None, "Vocabulary size before padding (set by the tokenizer; needed with --mock-data).")
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this (must be divisible by TP).")
    normalization: str = opt("LayerNorm", "Normalisation layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalisation layers.")
    swiglu: bool = opt(False, "Use SwiGLU in the MLP instead of GELU.")
    position_embedding_type: str = opt("learned_absolute", "Position encoding.", choices=["learned_absolute", "rope"])
    rotary_base: float = opt(10000.0, "Base of the rotary embedding frequencies.")
    untie_embeddings_and_output_weights: bool = opt(False, "Use a separate output matrix instead of the input embedding.")
    disable_bias_linear: bool = opt(False, "No biases in linear layers.")
    hidden_dropout: float = opt(0.0, "Dropout on the residual branches.")
    attention_dropout: float = opt(0.0, "Dropout on attention probabilities.")
    init_method_std: float = opt(0.02, "Std of the normal initialisation (output projections are scaled by 1/sqrt(2L)).")
    # Mixture of experts.
    num_experts: Optional[int] = opt(None, "Number of experts E (MoE MLP); unset or 0 means dense.")
    moe_layer_freq: int = opt(1, "Every k-th layer is MoE (layers k-1, 2k-1, ...; 1 means all).")
    moe_router_topk: int = opt(1, "Experts per token (top-1 Switch, top-2 GShard).")
    moe_ffn_hidden_size: Optional[int] = opt(None, "Expert FFN hidden size (default ffn-hidden-size).")
    moe_num_prototypes: int = opt(1, "Expert prototyping (M6-T): K groups, top-1 in each, outputs summed.")
    moe_aux_loss_coeff: float = opt(0.0, "Load-balancing loss coefficient (Switch formulation).")
    moe_z_loss_coeff: float = opt(0.0, "Router z-loss coefficient.")
    moe_capacity_factor: Optional[float] = opt(None, "Expert capacity factor; unset means dropless.")
    moe_input_jitter_eps: Optional[float] = opt(None, "Multiplicative router input jitter (training only).")
    moe_renormalize_topk: bool = opt(False, "Renormalise the top-k routing weights to sum to 1.")

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
        return self.hidden_size // self.num_attention_heads

    @property
    def add_bias(self) -> bool:
        return not self.disable_bias_linear

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (layer + 1) % self.moe_layer_freq == 0

    @property
    def padded_vocab_size(self) -> int:
        """Independent of TP (unlike Megatron's multiple-of-divisor-x-TP), so every layout
        has the same embedding shape and checkpoints reshard without re-padding."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "TP: shards of every layer's matrices.")
    pipeline_model_parallel_size: int = opt(1, "PP: pipeline stages.")
    expert_model_parallel_size: int = opt(1, "EP: ranks the experts are spread over (divides DP).")
    pipeline_layer_split: Optional[str] = opt(None, "Layers per stage, e.g. 3,5,5,3 (default even).")
    pipeline_schedule: str = opt("1f1b", "Pipeline schedule.", choices=["1f1b", "gpipe"])
    distributed_backend: str = opt("auto", "torch.distributed backend (auto: nccl on CUDA, gloo on CPU).",
                                   choices=["auto", "gloo", "nccl"])
    distributed_timeout_minutes: float = opt(10.0, "Timeout of every collective.")
    device: str = opt("auto", "Compute device (auto: cuda when available, else cpu).", choices=["auto", "cpu", "cuda"])


@dataclass
class TrainConfig:
    micro_batch_size: int = opt(4, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = opt(None, "Samples per optimizer step (default micro-batch x DP).")
    train_iters: int = opt(10, "Optimizer steps to train.")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(0.0, "Learning rate at the end of decay.")
    lr_warmup_iters: int = opt(0, "Linear warm-up steps.")
    lr_decay_iters: Optional[int] = opt(None, "Steps over which to decay (default train-iters).")
    lr_decay_style: str = opt("cosine", "Decay after warm-up.", choices=["cosine", "linear", "constant"])
    weight_decay: float = opt(0.01, "AdamW weight decay (not applied to norms and biases).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = opt(1234, "Seed of initialisation, data order and dropout.")
    bf16: bool = opt(False, "bfloat16 compute (fp32 master weights).")
    fp16: bool = opt(False, "float16 compute with dynamic loss scaling (fp32 master weights).")
    initial_loss_scale: float = opt(2.0 ** 16, "fp16: starting loss scale.")
    min_loss_scale: float = opt(1.0, "fp16: smallest loss scale.")
    loss_scale_window: int = opt(1000, "fp16: grow the scale after this many finite steps.")
    recompute_activations: bool = opt(False, "Recompute each layer's activations in backward.")
    max_skipped_steps: int = opt(10, "Stop after this many consecutive steps skipped for non-finite values.")
    exit_interval: Optional[int] = opt(None, "Save and exit when the iteration is a multiple of this.")
    exit_signal_handler: bool = opt(False, "Save and exit cleanly on SIGTERM.")


@dataclass
class P2RConfig:
    p2r_phase: str = opt("real", "Pseudo-to-Real phase.", choices=["pseudo", "real"])
    share_pattern: str = opt("all", "Pseudo phase: layer->slot map: all | cycle:K | block:K | none.")


@dataclass
class DataConfig:
    data_path: Optional[List[str]] = opt(None, "Dataset prefixes, optionally weighted: 0.3 A 0.7 B.", nargs="+")
    split: str = opt("969,30,1", "Train,valid,test proportions.")
    mock_data: bool = opt(False, "Deterministic synthetic data (no files).")
    data_cache_path: Optional[str] = opt(None, "Where index caches go (default beside the data).")
    tokenizer_type: Optional[str] = opt(None, "Tokenizer (docs/data.md).", choices=[
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
        "HuggingFaceTokenizer", "NullTokenizer", "ByteTokenizer"])
    tokenizer_model: Optional[str] = opt(None, "SentencePiece .model; HuggingFaceTokenizer: a directory with tokenizer.json, or that file.")
    vocab_file: Optional[str] = opt(None, "GPT-2 BPE vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT-2 BPE merges.txt.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = opt(None, "Save every N iterations.")
    load: Optional[str] = opt(None, "Directory to resume from.")
    finetune: bool = opt(False, "Load weights only: fresh optimizer, iteration 0.")
    no_load_optim: bool = opt(False, "Do not load optimizer state.")
    no_load_rng: bool = opt(False, "Do not load RNG state.")
    keep_last: Optional[int] = opt(None, "Keep only the newest N complete checkpoints.")


@dataclass
class LoggingConfig:
    log_interval: int = opt(1, "Log every N iterations.")
    log_file: Optional[str] = opt(None, "Append one JSON object per logged iteration here.")
    tensorboard_dir: Optional[str] = opt(None, "Write the logged scalars for TensorBoard here.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N iterations.")
    eval_iters: int = opt(2, "Batches per evaluation (a fixed, deterministic set).")
    eval_only: bool = opt(False, "Load, evaluate the validation loss, exit.")


@dataclass
class OffloadConfig:
    cpu_offload_layers: Optional[str] = opt(None, "Layers kept on host: N | 0.25 | 1,5,7 | auto.")
    cpu_offload_what: str = opt("params,grads,optimizer", "What of the offloaded layers lives on host.")
    offload_prefetch: int = opt(1, "Offloaded layers fetched ahead of use.")
    device_memory_budget: Optional[str] = opt(None, "With --cpu-offload-layers auto, e.g. 30GiB.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    p2r: P2RConfig = field(default_factory=P2RConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        kwargs = {}
        for f in dataclasses.fields(cls):
            sub = d.get(f.name, {})
            kwargs[f.name] = f.default_factory(**sub)
        return cls(**kwargs)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag(s) and what was expected."""


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def num_microbatches(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return global_batch_size(cfg, world_size) // (cfg.train.micro_batch_size * dp)


def global_batch_size(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return cfg.train.global_batch_size or cfg.train.micro_batch_size * dp


def _check_ranges(cfg: Config) -> None:
    """Single values outside their range (each crashed deep inside a run, or silently misbehaved)."""
    m, t, c, lg = cfg.model, cfg.train, cfg.checkpoint, cfg.logging
    at_least_one = [("--log-interval", lg.log_interval), ("--eval-iters", lg.eval_iters),
                    ("--max-skipped-steps", t.max_skipped_steps), ("--loss-scale-window", t.loss_scale_window)]
    disable = [("--save-interval", c.save_interval), ("--keep-last", c.keep_last), ("--exit-interval", t.exit_interval),
               ("--eval-interval", lg.eval_interval)]
    for name, value in at_least_one + [("--global-batch-size", t.global_batch_size)] + disable:
        if value is not None and value < 1:
            hint = " (leave it unset to disable)" if (name, value) in disable else ""
            raise ConfigError(f"{name} must be >= 1, got {value}{hint}")
    if t.train_iters < 0:
        raise ConfigError(f"--train-iters must be >= 0, got {t.train_iters}")
    if m.vocab_size is not None and m.vocab_size < 2:
        raise ConfigError(f"--vocab-size must be >= 2, got {m.vocab_size}")
    for name, value in [("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")
    for name, value in [("--norm-epsilon", m.norm_epsilon), ("--initial-loss-scale", t.initial_loss_scale),
                        ("--min-loss-scale", t.min_loss_scale)] + \
            ([("--moe-capacity-factor", m.moe_capacity_factor)] if m.moe_capacity_factor is not None else []):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if t.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {t.clip_grad}")
    if cfg.data.mock_data and cfg.data.data_path:
        raise ConfigError("--mock-data and --data-path are mutually exclusive (--mock-data would ignore the data)")


def validate(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for the first inconsistent setting (one message per rule)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    for name, value in [("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep), ("--micro-batch-size", t.micro_batch_size)]:
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size ({m.hidden_size}) must be divisible by "
                          f"--num-attention-heads ({m.num_attention_heads})")
    if m.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    if m.ffn_size % tp:
        raise ConfigError(f"--ffn-hidden-size ({m.ffn_size}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    if m.make_vocab_size_divisible_by % tp:
        raise ConfigError(f"--make-vocab-size-divisible-by ({m.make_vocab_size_divisible_by}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp}) so the padded vocabulary splits evenly")
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dimension, got {m.head_dim}")
    if m.max_positions < m.seq_length:
        raise ConfigError(f"--max-position-embeddings ({m.max_positions}) must be >= --seq-length ({m.seq_length})")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} must be divisible by --tensor-model-parallel-size ({tp}) "
                          f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
    dp = data_parallel_size(cfg, world_size)
    if dp % ep:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp} = "
                          f"world {world_size} / (TP {tp} x PP {pp}))")
    if pp > m.num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size ({pp}) exceeds --num-layers ({m.num_layers})")
    if m.num_experts is not None and m.num_experts < 0:
        raise ConfigError(f"--num-experts must be >= 0, got {m.num_experts}")
    if m.num_experts:
        if m.num_experts % ep:
            raise ConfigError(f"--num-experts ({m.num_experts}) must be divisible by "
                              f"--expert-model-parallel-size ({ep})")
        if m.expert_ffn_size % tp:
            raise ConfigError(f"--moe-ffn-hidden-size ({m.expert_ffn_size}) must be divisible by "
                              f"--tensor-model-parallel-size ({tp})")
        if m.num_experts % m.moe_num_prototypes:
            raise ConfigError(f"--num-experts ({m.num_experts}) must be divisible by "
                              f"--moe-num-prototypes ({m.moe_num_prototypes})")
        per_group = m.num_experts // m.moe_num_prototypes
        if m.moe_num_prototypes > 1 and m.moe_router_topk != 1:
            raise ConfigError("expert prototyping (--moe-num-prototypes > 1) takes top-1 in each group: "
                              f"--moe-router-topk must be 1, got {m.moe_router_topk}")
        if not 1 <= m.moe_router_topk <= per_group:
            raise ConfigError(f"--moe-router-topk ({m.moe_router_topk}) must be between 1 and "
                              f"--num-experts ({per_group})")
        if m.moe_layer_freq < 1:
            raise ConfigError(f"--moe-layer-freq must be >= 1, got {m.moe_layer_freq}")
    elif ep > 1:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    _check_ranges(cfg)
    gbs = global_batch_size(cfg, world_size)
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size "
                          f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")
    if t.lr_warmup_iters < 0 or t.min_lr > t.lr:
        raise ConfigError(f"need --lr-warmup-iters >= 0 and --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    d = cfg.data
    if not d.mock_data and not d.data_path and not cfg.logging.eval_only:
        raise ConfigError("no training data: pass --data-path PREFIX (from tools/preprocess_data.py) or --mock-data")
    if d.mock_data and m.vocab_size is None and d.tokenizer_type is None:
        raise ConfigError("--mock-data needs --vocab-size (or a --tokenizer-type to take it from)")
    c = cfg.checkpoint
    if c.save_interval is not None and not c.save and not cfg.logging.eval_only:
        raise ConfigError("--save-interval needs --save DIR")
    if (t.exit_interval or t.exit_signal_handler) and not c.save:
        raise ConfigError("--exit-interval / --exit-signal-handler need --save DIR to save to")
    # Late imports keep config free of model code; these modules validate their own syntax.
    from megatron_p2r.p2r.sharing import parse_share_pattern
    from megatron_p2r.pipeline.partition import stage_layer_counts
    parse_share_pattern(cfg.p2r.share_pattern, m.num_layers)
    stage_layer_counts(m.num_layers, pp, p.pipeline_layer_split)
    from megatron_p2r.optim.offload import validate_offload
    validate_offload(cfg)
