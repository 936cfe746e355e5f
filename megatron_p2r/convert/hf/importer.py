"""import-hf: write an HF model directory as a checkpoint of ours (real phase, iteration 0, no
optimizer state) in any layout, every needed tensor checked before anything is written."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_p2r.convert.hf.architecture import DEEPSEEK_V3, HFConversionError
from megatron_p2r.convert.hf.config_json import (
    import_vocab_divisor,
    model_values_from_hf,
    sliding_window,
)
from megatron_p2r.convert.hf.config_schema import required_field
from megatron_p2r.convert.hf.deepseek_v3 import mtp_depths
from megatron_p2r.convert.hf.directory import HFDirectory, read_hf_config
from megatron_p2r.convert.hf.rules import Rule, rules
from megatron_p2r.convert.hf.tokenizer import HFTokenizerFiles, copy_tokenizer, find_tokenizer
from megatron_p2r.convert.imported import write_imported
from megatron_p2r.convert.reshard import Target, target_config
from megatron_p2r.checkpoint.tensor_table import TensorInfo, tensor_table
from megatron_p2r.config import Config, ModelConfig

# HF tensors that are buffers, not weights (older GPT2 / Llama files carry them).
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$)")


def import_hf(
    src: str,
    dst: str,
    target: Target,
    *,
    make_vocab_size_divisible_by: Optional[int] = None,
    force: bool = False,
    progress: bool = True,
) -> Tuple[str, List[str]]:
    """Write the HF model SRC as a checkpoint of ours (real phase, iteration 0, no optimizer
    state) in the ``target`` layout. Returns (iteration directory, notes)."""
    hf_cfg = read_hf_config(src)
    where = os.path.join(src, "config.json")
    arch, values = model_values_from_hf(hf_cfg, where)
    hf_vocab = required_field(hf_cfg, "vocab_size", where)
    hf = HFDirectory(src)
    if arch == DEEPSEEK_V3:
        values["mtp_num_layers"] = mtp_depths(hf_cfg, hf.weight_map, where) or None
    found, note = find_tokenizer(src)
    cfg, tokenizer_note = _imported_config(values, hf_vocab, target, make_vocab_size_divisible_by, found)
    m = cfg.model
    all_rules = rules(m, arch, hf_vocab)
    plan = {key: (r, e) for r in all_rules for e, key in enumerate(r.pieces)}
    table = tensor_table(cfg)
    used = _check_pieces(src, hf, plan, table)
    expert_bias = _check_others(src, hf, [r for r in all_rules if not r.pieces], plan, used)
    _check_all_used(src, hf, used, m)
    notes = {"tokenizer": note or tokenizer_note}

    def copy_tokenizer_files(staging: str) -> dict:
        if found is None or tokenizer_note:
            return {}
        notes["tokenizer"], flags = copy_tokenizer(found, src, staging, dst)
        return flags

    out = write_imported(
        src,
        src,
        dst,
        cfg,
        table,
        lambda info, kind: _read_piece(hf, *plan[info.key]),
        history={"op": "import-hf", "source": os.path.abspath(src), "source_layout": f"hf:{arch}"},
        force=force,
        progress=progress,
        extras=copy_tokenizer_files,
        expert_bias=expert_bias or None,
    )
    return out, _notes(notes["tokenizer"], cfg, hf_cfg, hf_vocab, dst)


def _notes(tokenizer_note: str, cfg: Config, hf_cfg: dict, hf_vocab: int, dst: str) -> List[str]:
    m = cfg.model
    notes = [tokenizer_note]
    if m.padded_vocab_size != hf_vocab:
        notes.append(
            f"vocabulary padded from {hf_vocab} to {m.padded_vocab_size} rows with zeros "
            f"(TP {cfg.parallel.tensor_model_parallel_size} does not divide {hf_vocab}); their logits (0) "
            "enter our softmax"
        )
    if m.window_size is not None:
        skip = f", every {m.window_attn_skip_freq}th layer full" if m.window_attn_skip_freq else ""
        notes.append(f"sliding_window {sliding_window(hf_cfg)}: --window-size {m.window_size}{skip}")
    yaml_path = os.path.join(dst, "model.yaml")
    notes.append(
        f"model and layout flags in {yaml_path}: train with --config {yaml_path} --load {dst} "
        "--finetune plus data and training flags"
    )
    return notes


def _imported_config(
    values: dict, hf_vocab: int, target: Target, divisible_by: Optional[int], tokenizer: Optional[HFTokenizerFiles]
) -> Tuple[Config, str]:
    """Our config for the HF model's ``values`` in the ``target`` layout (unset sizes: 1), and why
    the tokenizer is not configured (empty when it is).

    Training takes --vocab-size from the tokenizer, so with a tokenizer of fewer tokens than
    the embedding has rows the divisor must pad its vocabulary back to exactly those rows."""
    tp = target.tensor_parallel_size or 1
    vocab, divisor, why = hf_vocab, import_vocab_divisor(hf_vocab, tp, divisible_by), ""
    if tokenizer is not None and tokenizer.vocab_size != hf_vocab:
        fitted = import_vocab_divisor(hf_vocab, tp, divisible_by, tokenizer.vocab_size)
        if fitted is None:
            why = (
                f"tokenizer not copied: its {tokenizer.vocab_size} tokens cannot be padded to the model's "
                f"{hf_vocab} embedding rows under TP {tp} (--make-vocab-size-divisible-by); pass a tokenizer "
                "with --tokenizer-type yourself"
            )
        else:
            vocab, divisor = tokenizer.vocab_size, fitted
    values.update(
        vocab_size=vocab, make_vocab_size_divisible_by=divisor, seq_length=min(values["max_position_embeddings"], 4096)
    )
    base = Config.from_dict({"model": values})
    cfg = target_config(
        base,
        Target(
            target.tensor_parallel_size or 1,
            target.pipeline_parallel_size or 1,
            target.pipeline_layer_split,
            target.expert_parallel_size,
        ),
        delink=False,
    )
    return cfg, why


def _stored(src: str, hf: HFDirectory, name: str, shape: tuple, key: str) -> str:
    """The stored name of HF tensor ``name``, checked to have ``shape`` (for our ``key``)."""
    stored = hf.resolve(name)
    if stored is None:
        raise HFConversionError(f"{src}: the weights have no tensor {name!r} (needed for our {key!r})")
    if tuple(hf.entry(stored)["shape"]) != shape:
        raise HFConversionError(
            f"{src}: tensor {stored!r} has shape {hf.entry(stored)['shape']}, config.json implies {list(shape)}"
        )
    return stored


def _check_pieces(src: str, hf: HFDirectory, plan: Dict[str, Tuple[Rule, int]], table: Dict[str, TensorInfo]) -> set:
    """Every tensor our model needs is there with the shape config.json implies; returns their stored names."""
    used = set()
    for key, info in table.items():
        r, _ = plan[key]
        stacked = (len(r.stack),) if r.stack else ()
        shapes = [stacked + tuple(t.shape) for t in r.to_hf(torch.empty(info.shape, device="meta"))]
        used.update(_stored(src, hf, name, shape, key) for name, shape in zip(r.hf, shapes, strict=True))
    return used


def _check_others(
    src: str, hf: HFDirectory, others: List[Rule], plan: Dict[str, Tuple[Rule, int]], used: set
) -> Dict[str, List[float]]:
    """The HF tensors that are no piece of ours: copies equal to the tensor they repeat, tensors
    we do not have all zeros; returns the expert biases ({our name: values})."""
    biases = {}
    for r in others:
        if r.kind == "copy":
            main = plan[r.ours][0].hf[0]
            stored = _stored(src, hf, r.hf[0], tuple(hf.entry(hf.resolve(main))["shape"]), r.ours)
            if not torch.equal(hf.read(stored), hf.read(hf.resolve(main))):
                raise HFConversionError(f"{src}: {stored!r} differs from {main!r}; our model shares one tensor")
        else:
            stored = _stored(src, hf, r.hf[0], r.zero_shape, r.ours or r.hf[0])
            values = hf.read(stored).float()
            if r.kind == "expert_bias":
                biases[r.ours] = values.tolist()
            elif values.any():
                raise HFConversionError(f"{src}: {stored!r} is not zero; our model has no such tensor")
        used.add(stored)
    return biases


def _check_all_used(src: str, hf: HFDirectory, used: set, m: ModelConfig) -> None:
    """Every HF weight has a place in our model (none is silently dropped)."""
    unused = sorted(
        n
        for n in hf.weight_map
        if n not in used
        and not _IGNORED.search(n)
        and not (n == "lm_head.weight" and not m.untie_embeddings_and_output_weights)
    )
    if unused:
        raise HFConversionError(
            f"{src}: {len(unused)} tensors have no place in our model, e.g. {unused[0]!r}; refusing to drop weights"
        )


def _read_piece(hf: HFDirectory, rule: Rule, index: int) -> torch.Tensor:
    """Our global piece (the ``index``-th of the rule's), made from its HF tensors (fp32, contiguous)."""
    tensors = [hf.read(hf.resolve(n)) for n in rule.hf]
    if rule.stack:
        tensors = [t[index] for t in tensors]
    return rule.from_hf([t.float() for t in tensors]).to(torch.float32).contiguous()
