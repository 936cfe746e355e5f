"""Megatron-LM's flags that are not config fields, and what each does here.

``pretrain_m6.py`` accepts every flag of Megatron-LM's example launch scripts (docs/megatron.md
lists them with their status; ``tests/config/test_megatron_scripts.py`` checks that list against this
table). A flag named like a config field has Megatron-LM's meaning and default there. The others:

- ``MEANING``: what the flag asks for is how this framework always works (``--calculate-per-token-loss``);
- ``NO_EFFECT``: it only picks a kernel, a communication pattern or an integration we do not have;
  accepted, and reported once at start ("no effect here: ...");
- ``REFUSED``: it would change the math and is not implemented; the parser accepts it only to stop
  with an error that names it.

Every other flag of Megatron-LM's parser (``megatron_parser.json``, generated from its own
``add_megatron_arguments`` by ``tools/megatron_parser.py``) has the status of its family in
``config/megatron_families.py`` and is parsed as Megatron-LM parses it.

Some depend on the value: ``--moe-token-dispatcher-type alltoall`` means what it says; another value has no effect. A config
field is here only when some of its values need saying (``config_field``): ``--sequence-parallel``
with one tensor-parallel rank has no effect, as in Megatron-LM. The module imports nothing else of
megatron_p2r, so the table can be read without building anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.megatron_families import FAMILIES, MEANING, NO_EFFECT, REFUSED, STATUSES

if TYPE_CHECKING:
    from megatron_p2r.config.root import Config

PARSER_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_parser.json")
__all__ = ["MEANING", "NO_EFFECT", "REFUSED", "STATUSES", "MEGATRON_FLAGS", "MegatronFlag", "check_flags"]


@dataclass(frozen=True)
class MegatronFlag:
    status: str
    reason: str
    parse: dict = field(default_factory=dict)  # argparse keywords as Megatron-LM parses it; none for a field
    config_field: bool = False  # a config field parses it; the entry qualifies its values
    keeps: Optional[Callable[[object, "Config"], bool]] = None  # the values that have ``status``
    otherwise: Tuple[str, str] = (REFUSED, "")  # (status, reason) of the other values

    def resolve(self, value, cfg: "Config") -> Tuple[str, str]:
        """(status, reason) of this flag given ``value``."""
        if self.keeps is None or self.keeps(value, cfg):
            return self.status, self.reason
        return self.otherwise


def _switch() -> dict:
    return {"action": "store_true"}


def _value(kind, choices=None, nargs=None) -> dict:
    return {key: value for key, value in (("type", kind), ("choices", choices), ("nargs", nargs)) if value}


def _kernel(what: str, parse: Optional[dict] = None) -> MegatronFlag:
    return MegatronFlag(NO_EFFECT, f"{what}: a kernel choice, the same math", parse or _switch())


_MODELOPT = "a ModelOpt flag (pretrain_gpt.py parses it only with nvidia-modelopt installed)"

MEGATRON_FLAGS: Dict[str, MegatronFlag] = {
    # Kernels and implementations.
    "--use-mcore-models": MegatronFlag(
        NO_EFFECT, "picks Megatron's model code (Megatron-LM ignores it too)", _switch()
    ),
    "--openai-gelu": MegatronFlag(
        NO_EFFECT,
        "megatron-core never reads it (only the legacy models Megatron-LM "
        "removed did): GELU is the tanh approximation only through the bias-GELU fusion "
        "(off with --no-bias-gelu-fusion), here as there",
        _switch(),
    ),
    "--transformer-impl": _kernel(
        "Transformer Engine or local layers", _value(str, ["local", "transformer_engine", "inference_optimized"])
    ),
    "--attention-backend": _kernel("attention kernel", _value(str, ["flash", "fused", "unfused", "local", "auto"])),
    "--use-flash-attn": _kernel("FlashAttention"),
    "--no-masked-softmax-fusion": _kernel("fused masked softmax"),
    "--no-bias-swiglu-fusion": _kernel("fused bias+SwiGLU"),
    "--no-bias-dropout-fusion": _kernel("fused bias+dropout+add"),
    "--no-rope-fusion": _kernel("fused rotary embedding"),
    "--no-gradient-accumulation-fusion": _kernel("fused weight-gradient accumulation"),
    "--cross-entropy-loss-fusion": _kernel("fused cross entropy"),
    "--moe-permute-fusion": _kernel("fused token permutation"),
    "--export-force-local-attention": MegatronFlag(
        NO_EFFECT, f"{_MODELOPT}: picks Megatron's local attention kernel over Transformer Engine's", _switch()
    ),
    "--attention-softmax-in-fp32": MegatronFlag(
        NO_EFFECT,
        "the unfused kernel's softmax precision: SDPA's fused "
        "kernels accumulate the softmax in fp32 with 16-bit inputs",
        _switch(),
    ),
    "--disable-bf16-reduced-precision-matmul": MegatronFlag(
        NO_EFFECT,
        "a cuBLAS rounding setting for bf16 GEMMs (reduced-precision reductions): torch's default is kept",
        _switch(),
    ),
    "--no-persist-layer-norm": _kernel("persistent LayerNorm"),
    "--grad-reduce-in-bf16": MegatronFlag(
        NO_EFFECT,
        "gradients are accumulated and reduced in fp32 (Megatron's default with --bf16): only bf16 rounding differs",
        _switch(),
    ),
    "--apply-layernorm-1p": MegatronFlag(
        NO_EFFECT,
        "Megatron keeps each norm weight as w = gamma - 1: the fp32 "
        "mains (gamma = 1 + w here) and AdamW's steps (no weight decay on norms) "
        "agree up to fp32 rounding; with --bf16/--fp16 the 16-bit copy the forward "
        "reads is rounded at gamma here, at w there",
        _switch(),
    ),
    # Memory, processes, I/O and integrations.
    "--manual-gc": MegatronFlag(NO_EFFECT, "Python garbage-collection timing", _switch()),
    "--empty-unused-memory-level": MegatronFlag(NO_EFFECT, "CUDA cache release", _value(int, [0, 1, 2])),
    "--num-workers": MegatronFlag(
        NO_EFFECT, "data-loader worker processes (samples are read in the training process)", _value(int)
    ),
    "--no-mmap-bin-files": MegatronFlag(NO_EFFECT, ".bin files are memory-mapped here: the same data", _switch()),
    "--ckpt-format": MegatronFlag(
        NO_EFFECT,
        "checkpoints are in this framework's format (docs/checkpoint.md)",
        _value(str, ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"]),
    ),
    "--logging-level": MegatronFlag(
        NO_EFFECT,
        "the level of Megatron-LM's Python loggers: this framework prints its log lines and errors at any level",
        _value(int),
    ),
    "--moe-per-layer-logging": MegatronFlag(
        NO_EFFECT, "per-layer MoE losses in the log: the log line has their total (moe_aux_loss)", _switch()
    ),
    "--init-model-with-meta-device": MegatronFlag(
        NO_EFFECT,
        "where the model is first built (Megatron-FSDP materialises it shard by shard): the same initial weights",
        _switch(),
    ),
    **{
        flag: MegatronFlag(NO_EFFECT, f"{what}: Megatron-FSDP's communication buffers (refused here)", _switch())
        for flag, what in (
            ("--use-nccl-ub", "NCCL user-buffer registration"),
            ("--fsdp-double-buffer", "double-buffered all-gathers"),
            ("--fsdp-manual-registration", "manual NCCL buffer registration"),
        )
    },
    "--data-parallel-sharding-strategy": MegatronFlag(
        NO_EFFECT,
        "read by Megatron-FSDP only (refused here)",
        _value(str, ["no_shard", "optim", "optim_grads", "optim_grads_params"]),
    ),
    # How this framework always works.
    "--calculate-per-token-loss": MegatronFlag(
        MEANING, "the loss is always the mean over the global batch's loss tokens", _switch()
    ),
    "--log-throughput": MegatronFlag(MEANING, "tokens/s and TFLOP/s per rank are always logged", _switch()),
    "--no-create-attention-mask-in-dataloader": MegatronFlag(
        MEANING, "the causal mask is made in the model, never by the data loader", _switch()
    ),
    "--no-position-embedding": MegatronFlag(
        MEANING,
        "rotary positions have no learned table",
        _switch(),
        keeps=lambda value, cfg: cfg.model.position_embedding_type == "rope",
        otherwise=(REFUSED, "without --position-embedding-type rope (Megatron-LM refuses it too)"),
    ),
    "--moe-token-dispatcher-type": MegatronFlag(
        MEANING,
        "tokens go to their experts by all-to-all over the EP group",
        _value(str, ["allgather", "alltoall", "flex"]),
        keeps=lambda value, cfg: value == "alltoall",
        otherwise=(NO_EFFECT, "a communication pattern: tokens go by all-to-all here, with the same result"),
    ),
    "--accumulate-allreduce-grads-in-fp32": MegatronFlag(
        MEANING, "gradients are always accumulated and reduced in fp32", _switch()
    ),
    "--no-check-for-nan-in-loss-and-grad": MegatronFlag(
        NO_EFFECT,
        "the check is always on here: a step with a non-finite loss or gradient is skipped on every rank "
        "(--max-skipped-steps in a row stop the run)",
        _switch(),
    ),
    "--moe-router-dtype": MegatronFlag(
        MEANING,
        "the router's softmax and the weighted sum of expert outputs are fp32 here",
        _value(str, ["fp32", "fp64"]),
        keeps=lambda value, cfg: value == "fp32",
        otherwise=(REFUSED, "fp64 routing is not implemented (fp32 here)"),
    ),
    "--enable-gpt-oss": MegatronFlag(
        NO_EFFECT,
        f"{_MODELOPT}, read only when a ModelOpt checkpoint is loaded: a run without --load keeps plain "
        "rotary embeddings, there and here",
        _switch(),
        keeps=lambda value, cfg: cfg.checkpoint.load is None,
        otherwise=(
            REFUSED,
            "with a loaded ModelOpt checkpoint Megatron-LM switches to gpt-oss's YaRN rotary "
            "scaling with ModelOpt's fixed values, which a load does not do here: pass --rope-type "
            "yarn with the --yarn-* options instead",
        ),
    ),
    "--use-megatron-fsdp": MegatronFlag(
        REFUSED,
        "Megatron-FSDP shards gradients and 16-bit weights over the data-parallel ranks as well "
        "(--data-parallel-sharding-strategy optim_grads_params, its default), which is not implemented: "
        "--use-distributed-optimizer shards the fp32 main weights and Adam moments only (ZeRO-1), the same math "
        "with whole weights and fp32 gradients on every rank; drop this flag to train that way",
        _switch(),
    ),
    "--lr-warmup-init": MegatronFlag(
        MEANING,
        "warm-up starts from 0",
        _value(float),
        keeps=lambda value, cfg: value == 0.0,
        otherwise=(REFUSED, "the warm-up always starts from 0 here"),
    ),
    # Math we do not implement.
    "--rotary-interleaved": MegatronFlag(REFUSED, "interleaved (RoFormer) rotary pairs are not implemented", _switch()),
    "--squared-relu": MegatronFlag(REFUSED, "squared-ReLU MLPs are not implemented", _switch()),
    "--apply-residual-connection-post-layernorm": MegatronFlag(
        REFUSED, "post-norm residuals are not implemented", _switch()
    ),
    "--init-method-xavier-uniform": MegatronFlag(REFUSED, "Xavier initialisation is not implemented", _switch()),
    "--loss-scale": MegatronFlag(
        REFUSED, "a static loss scale is not implemented (--fp16 scales dynamically)", _value(float)
    ),
    "--decrease-batch-size-if-needed": MegatronFlag(REFUSED, "the global batch is never shrunk to fit", _switch()),
    "--overlap-p2p-communication-warmup-flush": MegatronFlag(
        MEANING,
        "receives are posted ahead in every op of the step, warm-up and flush included",
        _switch(),
        keeps=lambda value, cfg: cfg.parallel.overlap_p2p_communication,
        otherwise=(
            REFUSED,
            "needs the p2p overlap, which --no-overlap-p2p-communication turns off (Megatron-LM "
            "asks the same): drop one of the two",
        ),
    ),
    # Config fields with a value that has no effect.
    "--overlap-p2p-communication": MegatronFlag(
        MEANING,
        "config field",
        config_field=True,
        keeps=lambda value, cfg: cfg.parallel.num_model_chunks(cfg.model.num_layers) > 1,
        otherwise=(NO_EFFECT, "without interleaved 1F1B (Megatron-LM turns it off too)"),
    ),
    "--sequence-parallel": MegatronFlag(
        MEANING,
        "config field",
        config_field=True,
        keeps=lambda value, cfg: cfg.parallel.tensor_model_parallel_size > 1,
        otherwise=(NO_EFFECT, "with --tensor-model-parallel-size 1 (Megatron-LM turns it off too)"),
    ),
}


_BERT = "read by Megatron's BERT scripts only"
# Values of a config field's flag that Megatron-LM takes and this framework does not build: the
# parser takes them too, to refuse them by name.
UNBUILT_VALUES: Dict[str, Dict[str, str]] = {
    "--cp-comm-type": {"a2a+p2p": "hierarchical a2a+p2p is not implemented"},
    "--optimizer": {
        "sgd": "SGD with momentum is not built (adam, lion and adafactor are)",
        "muon": "Muon is not built",
        "dist_muon": "Muon is not built",
        "adaptive_muon": "Muon is not built (a Megatron-LM value newer than core_v0.16.1)",
        "soap": "SOAP is not built (a Megatron-LM value newer than core_v0.16.1)",
    },
    "--position-embedding-type": {
        "mrope": "multimodal rotary sections are not built",
        "relative": "T5's relative position buckets are not built",
        "none": "a model without position embeddings is not built",
    },
    "--moe-router-score-function": {
        "sqrtsoftplus": "the sqrt(softplus) score function is not built (softmax and sigmoid are)",
    },
    "--moe-router-load-balancing-type": {
        "global_aux_loss": "the global-batch auxiliary loss is not built (aux_loss and seq_aux_loss are)",
        "sinkhorn": "Sinkhorn routing is not built",
        "quantile_balancing": "quantile balancing is not built (--moe-router-enable-expert-bias balances without a loss)",
    },
    "--lr-decay-style": {
        "inverse-square-root": "the inverse-square-root decay is not built",
        "WSD": "the warmup-stable-decay schedule is not built",
    },
    "--dataloader-type": {
        "cyclic": "the random sampler over epochs is not built: samples come in the dataset's "
        "own shuffled order (single)",
        "external": "a user-supplied data loader is not built",
    },
    "--tokenizer-type": {
        "BertWordPieceLowerCase": _BERT,
        "BertWordPieceCase": _BERT,
        "MultimodalTokenizer": "multimodal tokenizers are not built",
        "NullMultimodalTokenizer": "multimodal tokenizers are not built",
        "SFTTokenizer": "supervised fine-tuning's tokenizer is not built",
    },
}


def unbuilt_values(values: Dict[str, object]) -> Dict[str, str]:
    """{flag: "FLAG VALUE: reason"} of each {flag: value} that UNBUILT_VALUES refuses."""
    return {
        flag: f"{flag} {value}: {UNBUILT_VALUES[flag][value]}"
        for flag, value in values.items()
        if isinstance(value, str) and value in UNBUILT_VALUES.get(flag, {})
    }


def megatron_parser() -> dict:
    """Megatron-LM's parser as tools/megatron_parser.py wrote it down (revision, actions)."""
    with open(PARSER_TABLE, encoding="utf-8") as fh:
        return json.load(fh)


_TYPES = {"int": int, "float": float, "str": str, "bool": str}


def _parse_of(action: dict) -> dict:
    """argparse keywords for one of Megatron's actions: a switch (store_true/false, either spelling
    of a BooleanOptionalAction) is given or not; a value keeps its type, nargs and choices (choices
    of Megatron's own value parsers, such as signal numbers, are left to them: text here)."""
    if action["action"] != "store":
        return _switch()
    kind = _TYPES[action["type"] or "str"]
    choices = action["choices"] if action["choices"] and all(isinstance(c, kind) for c in action["choices"]) else None
    return _value(kind, choices, action["nargs"])


def _family_entries() -> Dict[str, MegatronFlag]:
    """An entry for every flag of Megatron's parser that a family of megatron_families.py names (any
    spelling of an action names all of them); a refused value flag given at Megatron's default asks
    for nothing."""
    status_of = {flag: (status, reason) for status, reason, flags in FAMILIES for flag in flags}
    entries = {}
    for action in megatron_parser()["actions"]:
        named = [status_of[flag] for flag in action["flags"] if flag in status_of]
        if not named:
            continue
        status, reason = named[0]
        parse, default = _parse_of(action), action["default"]
        keeps = None
        if status == REFUSED and "type" in parse and default is not None:
            keeps = lambda value, cfg, default=default: value != default  # noqa: E731
        for flag in action["flags"]:
            entries[flag] = MegatronFlag(
                status, reason, parse, keeps=keeps, otherwise=(MEANING, "Megatron-LM's default: what happens here")
            )
    return entries


# Config fields this framework named before it took Megatron-LM's flag: Megatron's name sets the
# same field (checkpoints' saved configs keep the field's name).
MEGATRON_NAMES = {"--moe-capacity-factor": ["--moe-expert-capacity-factor"]}


def megatron_aliases() -> Dict[str, List[str]]:
    """Megatron's other spellings of a flag this table or a config field has under its first name
    (--persistent-save-interval for --save-interval, and MEGATRON_NAMES): {first flag: [the others]}."""
    return {
        **{
            action["flags"][0]: action["flags"][1:]
            for action in megatron_parser()["actions"]
            if len(action["flags"]) > 1
            and action["action"] != "boolean_optional"
            and action["flags"][0] not in MEGATRON_FLAGS
        },
        **MEGATRON_NAMES,
    }


MEGATRON_FLAGS.update({flag: entry for flag, entry in _family_entries().items() if flag not in MEGATRON_FLAGS})


def parsed_flags() -> Dict[str, MegatronFlag]:
    """The table's flags the parser adds itself (the others come with their config fields)."""
    return {flag: entry for flag, entry in MEGATRON_FLAGS.items() if not entry.config_field}


def check_flags(given: Dict[str, object], cfg: "Config", refused: Tuple[str, ...] = ()) -> List[str]:
    """Raise one ConfigError naming every refused flag (and the ``refused`` already found);
    return "FLAG (reason)" of those with no effect."""
    refused, no_effect = list(refused), []
    for flag, value in given.items():
        status, reason = MEGATRON_FLAGS[flag].resolve(value, cfg)
        shown = flag if value is True else f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        if status == REFUSED:
            refused.append(f"{shown}: {reason}")
        elif status == NO_EFFECT:
            no_effect.append(f"{flag} ({reason})")
    if refused:
        raise ConfigError("not supported here (docs/megatron.md): " + "; ".join(refused))
    return no_effect


def implied_values(values: dict) -> dict:
    """Megatron-LM's ``pretrain_gpt.py`` defaults --tokenizer-type to GPT2BPETokenizer: here when
    --vocab-file is given without a type (with neither, --vocab-size sizes a run without one)."""
    if values.get("tokenizer_type") is None and values.get("vocab_file"):
        return {**values, "tokenizer_type": "GPT2BPETokenizer"}
    return values
