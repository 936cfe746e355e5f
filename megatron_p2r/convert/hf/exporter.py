"""export-hf: write a checkpoint of ours (any layout, real or pseudo) as an HF model directory,
streaming one piece at a time into safetensors shards planned from shapes alone."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from megatron_p2r.convert.hf.architecture import QWEN2, HFConversionError, hf_architecture
from megatron_p2r.convert.hf.config_json import hf_config
from megatron_p2r.convert.hf.directory import INDEX_FILE, parse_size, plan_shards, weight_file_names, write_json
from megatron_p2r.convert.hf.rules import Rule, rules
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.hf.tokenizer import export_tokenizer
from megatron_p2r.checkpoint.safetensors_io import SAFETENSORS_DTYPE, ShardWriter, nbytes
from megatron_p2r.checkpoint.staging import staged_output
from megatron_p2r.checkpoint.tensor_table import TensorInfo, tensor_table
from megatron_p2r.config import ModelConfig

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class ExportResult:
    directory: str
    architecture: str
    files: List[str]
    vocab_size: int
    notes: List[str]


def export_hf(
    src: str,
    dst: str,
    *,
    trim_vocab: bool = False,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    architecture: Optional[str] = None,
    force: bool = False,
    progress: bool = True,
) -> ExportResult:
    """Write SRC (any layout, real or pseudo) as an HF model directory DST, streaming; as
    ``architecture`` (an HF class name) when given, else the one the model's options point to."""
    if dtype not in EXPORT_DTYPES:
        raise HFConversionError(f"--dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    source = SourceCheckpoint(src)
    m = source.real_cfg.model
    arch = hf_architecture(m, architecture)
    limit = parse_size(max_shard_size)
    hf_vocab = m.vocab_size if trim_vocab else m.padded_vocab_size
    torch_dtype = EXPORT_DTYPES[dtype]
    table = tensor_table(source.real_cfg)
    plan = rules(m, arch, hf_vocab)
    groups = _output_groups(plan, table, SAFETENSORS_DTYPE[torch_dtype], arch)
    files = plan_shards(groups, limit)
    names = weight_file_names(len(files))
    with staged_output(src, source.iter_dir, dst, force) as tmp:
        _write_weights(tmp, source, plan, groups, dict(zip(names, files, strict=True)), torch_dtype, progress)
        note, special = export_tokenizer(source.cfg, tmp)
        write_json(os.path.join(tmp, "config.json"), hf_config(m, arch, hf_vocab, dtype, special))
    notes = _notes(note, source, m, hf_vocab)
    if arch == QWEN2 and source.cfg.data.tokenizer_type == "HuggingFaceTokenizer":
        notes.append(
            "transformers 5 loads a Qwen2 directory's tokenizer.json with Qwen2Tokenizer, which imposes "
            "Qwen2's pre-tokenizer: a tokenizer.json with another one encodes differently there"
        )
    return ExportResult(dst, arch, names, hf_vocab, notes)


def _output_groups(plan: List[Rule], table: Dict[str, TensorInfo], st_dtype: str, arch: str) -> List[list]:
    """[(HF name, dtype, shape)] of each rule's outputs, from shapes alone (meta tensors)."""
    covered = {key for r in plan for key in r.pieces}
    if covered != set(table):  # the mapping must account for every weight, no more, no less
        raise HFConversionError(
            f"internal: {arch} mapping misses {sorted(set(table) - covered)[:3]} "
            f"or invents {sorted(covered - set(table))[:3]}"
        )
    groups = []
    for r in plan:
        if r.kind == "copy" or r.pieces:
            stacked = (len(r.stack),) if r.stack else ()
            piece = torch.empty(table[r.stack[0] if r.stack else r.ours].shape, device="meta")
            shapes = [stacked + tuple(t.shape) for t in r.to_hf(piece)]
        else:
            shapes = [r.zero_shape]
        dtype = SAFETENSORS_DTYPE[torch.float32] if r.kind == "expert_bias" else st_dtype  # as transformers keeps it
        groups.append([(name, dtype, s) for name, s in zip(r.hf, shapes, strict=True)])
    return groups


def _write_weights(
    out: str,
    source: SourceCheckpoint,
    plan: List[Rule],
    groups: List[list],
    files: Dict[str, Sequence[int]],
    torch_dtype: torch.dtype,
    progress: bool,
) -> None:
    """Each weight file (name -> the rules it holds), one piece converted at a time; the index
    when there are several files."""
    total = sum(nbytes(d, s) for g in groups for _, d, s in g)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="export-hf")
    weight_map = {}
    for name, members in files.items():
        entries = [e for i in members for e in groups[i]]
        writer = ShardWriter(os.path.join(out, name), entries, {"format": "pt"})
        for i in members:
            outs = _hf_tensors(source, plan[i], torch_dtype)
            for (hf_name, _, _), t in zip(groups[i], outs, strict=True):
                writer.write(hf_name, t)
                weight_map[hf_name] = name
                bar.update(t.numel() * t.element_size())
        writer.close()
    bar.close()
    if len(files) > 1:
        write_json(os.path.join(out, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})


def _hf_tensors(source: SourceCheckpoint, r: Rule, torch_dtype: torch.dtype) -> List[torch.Tensor]:
    """The HF tensors of rule ``r``: zeros, its piece's, its experts' stacked, or an expert bias (fp32)."""
    if r.kind == "expert_bias":
        bias = source.expert_bias(r.ours)
        return [torch.zeros(r.zero_shape) if bias is None else bias]
    if r.kind == "copy" or (r.pieces and not r.stack):
        return r.to_hf(source.read(r.ours).to(torch_dtype))
    if not r.pieces:
        return [torch.zeros(r.zero_shape, dtype=torch_dtype)]
    per_expert = [r.to_hf(source.read(key).to(torch_dtype)) for key in r.stack]
    return [torch.stack(parts) for parts in zip(*per_expert, strict=True)]


def _notes(tokenizer_note: str, source: SourceCheckpoint, m: ModelConfig, hf_vocab: int) -> List[str]:
    notes = [tokenizer_note]
    if source.pseudo:
        notes.append(f"delinked on the fly from the pseudo phase (layer -> module {source.layer_keys})")
    if hf_vocab != m.padded_vocab_size:
        notes.append(f"vocabulary trimmed from {m.padded_vocab_size} (padded) to {hf_vocab} rows")
    elif m.vocab_size != hf_vocab:
        notes.append(f"vocabulary kept padded: {hf_vocab} rows for {m.vocab_size} tokens (--trim-vocab cuts it)")
    return notes
