"""Inspect, delink (pseudo -> real), grow (deeper) and reshard (TP/PP/EP) megatron_p2r checkpoints.

    p2r-convert-checkpoint inspect DIR [--verify]
    p2r-convert-checkpoint delink SRC DST [--optimizer-state copy|rescale|reset] [--noise-std S [--noise-relative]]
                                          [--lr-rewarmup-iters N] [--target-share-pattern none|cycle:K|...]
                                          [--target-* ...]
    p2r-convert-checkpoint grow SRC DST --num-layers L [--method stack|interleave] [same options as delink]
    p2r-convert-checkpoint reshard SRC DST [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]
                                           [--target-pipeline-layer-split 3,5] [--target-expert-parallel-size E]
    p2r-convert-checkpoint export-hf SRC DST [--trim-vocab] [--dtype float32|bfloat16|float16]
                                             [--max-shard-size 5GB] [--hf-architecture CLASS] [--verify]
    p2r-convert-checkpoint import-hf SRC DST [--target-* ...] [--make-vocab-size-divisible-by N]
    p2r-convert-checkpoint import-megatron MEGATRON_DIR DST [--target-* ...]
                                            (a Megatron-LM torch_dist or legacy checkpoint; docs/megatron.md)
    p2r-convert-checkpoint export-megatron SRC MEGATRON_DIR [--ckpt-format torch_dist|torch]
                                            [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]
                                            [--target-expert-parallel-size E] [--dtype float32|bfloat16|float16]
                                            [--no-save-optim]

SRC is a checkpoint directory (its latest iteration is used) or one ``iter_*`` directory; DST
becomes a checkpoint directory that ``--load`` accepts. Conversions stream tensor by tensor into
a staging directory of their own inside DST and move it in when verified; SRC is never modified,
DST is locked from the start and replaced only with ``--force``, never while a live run writes in
it. ``inspect --verify`` reads every tensor against its checksum. See docs/checkpoint.md; delink
and grow: docs/p2r.md.
``export-hf`` writes a Hugging Face transformers model directory (GPT2, Llama, Qwen2 or Mixtral,
chosen by the model's options, or Mistral on request), ``import-hf`` reads one back into a
checkpoint; see docs/hf.md. ``export-megatron`` writes a ``--save`` directory Megatron-LM loads;
see docs/megatron.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from megatron_p2r.convert.hf.architecture import MODEL_TYPES
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.convert.hf.importer import import_hf
from megatron_p2r.convert.hf.verify import VERIFY_TOLERANCE, verify_export
from megatron_p2r.checkpoint.integrity import check_data, check_files
from megatron_p2r.convert.megatron.exporter import CKPT_FORMATS, EXPORT_DTYPES, export_megatron
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.checkpoint.metadata import checksum_coverage, kinds_of, metadata_config, metadata_table, read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.convert.reshard import DelinkOptions, GrowOptions, Target, convert
from megatron_p2r.checkpoint.tensor_table import ShardLayout
from megatron_p2r.cli import run_tool
from megatron_p2r.p2r.delink import OPTIMIZER_STATE_MODES
from megatron_p2r.p2r.grow import GROW_METHODS

GROW_NOTE = (
    "note: growth is not function-preserving: the grown model applies each source layer k times, "
    "so its loss after the switch differs from the source's (expect a jump, then faster progress "
    "than a model of the source's depth)"
)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def inspect(path: str, verify: bool = False) -> str:
    """The metadata and a table of tensors (name, global shape, split dims, bytes), totals per file;
    with ``verify`` every tensor is read and checked against its checksum."""
    iter_dir = resolve_iteration_dir(path)
    meta = read_metadata(iter_dir)
    readers = check_files(iter_dir, meta)
    cfg, table = metadata_config(meta), metadata_table(meta)
    layout = ShardLayout.of(cfg)
    m, p2r = cfg.model, meta["p2r"]
    lines = [
        f"checkpoint   {iter_dir}",
        f"format       version {meta['format_version']}",
        f"iteration    {meta['iteration']}   consumed samples {meta['consumed_samples']}",
        f"model        {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads} "
        f"(key/value {m.query_groups}, dim {m.head_dim}), "
        f"ffn {m.ffn_size}, vocab {m.padded_vocab_size} (padded), experts {m.num_experts or 0}",
        f"phase        {p2r['phase']}   share pattern {p2r['share_pattern']}   "
        f"layer -> module {p2r['layer_module_keys']}",
        f"layout       TP={layout.tp} PP={layout.pp} EP={layout.ep}   layers per stage "
        f"{[b - a for a, b in layout.stage_layers]}",
        f"optimizer    {meta['config']['train'].get('optimizer', 'adam')} state ({', '.join(kinds_of(meta)[1:])})"
        if meta["optimizer"]
        else "optimizer    none",
        f"scheduler    {meta.get('scheduler')}",
        f"rng          {'per rank, world size ' + str(meta['rng']['world_size']) if meta.get('rng') else 'none'}",
    ]
    for h in meta.get("history", []):
        lines.append(f"history      {h['op']} from {h['source']} (layout {h['source_layout']})")
    lines.append("")
    rows = [("tensor", "global shape", "tp_dim", "expert", "stage", "layers", "bytes")]
    for key, info in table.items():
        rows.append(
            (
                key,
                "x".join(map(str, info.shape)) or "scalar",
                "-" if info.tp_dim is None else str(info.tp_dim),
                "-" if info.expert is None else str(info.expert),
                str(info.stage),
                ",".join(map(str, info.layers)) or "-",
                _human(info.nbytes),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = enumerate(zip(r, widths, strict=True))
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in cells))
    params = sum(i.numel for i in table.values())
    lines.append(
        f"\n{len(table)} tensors, {params:,} parameters, "
        f"{_human(sum(i.nbytes for i in table.values()))} of weights; stored: {', '.join(kinds_of(meta))}"
    )
    lines.append("\nper file (rank TT_PPP_EEE):")
    for name, size in meta["files"].items():
        lines.append(f"  {name}  {len(readers(name).entries):5d} tensors  {_human(size):>10}")
    lines.append(f"  total {_human(sum(meta['files'].values()))} in {len(meta['files'])} files")
    if verify:
        read = check_data(meta, readers)
        lines.append(f"\nverified: {read} tensors read, {checksum_coverage(meta)}")
    return "\n".join(lines)


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-tensor-parallel-size", type=int, help="TP of the result (default: the source's).")
    p.add_argument("--target-pipeline-parallel-size", type=int, help="PP of the result (default: the source's).")
    p.add_argument("--target-pipeline-layer-split", help="Layers per stage of the result, e.g. 3,5 (default even).")
    p.add_argument("--target-expert-parallel-size", type=int, help="EP of the result (default: the source's).")
    p.add_argument("--force", action="store_true", help="Replace a non-empty DST.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")


def _add_copy_flags(p: argparse.ArgumentParser) -> None:
    """The flags delink and grow share: what each copied module gets, and the target."""
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--optimizer-state",
        choices=OPTIMIZER_STATE_MODES,
        default=DelinkOptions.optimizer_state,
        help="Moments of each copy: the source module's, rescaled by its share of the uses (M/N, (M/N)^2), or reset.",
    )
    p.add_argument(
        "--noise-std",
        type=float,
        default=0.0,
        help="Add N(0, std^2) noise to every copied layer weight (std at most 1).",
    )
    p.add_argument(
        "--noise-relative",
        action="store_true",
        help="--noise-std is a fraction of each tensor's own std (0.01: 1%% of it).",
    )
    p.add_argument(
        "--lr-rewarmup-iters",
        type=int,
        default=0,
        help="Ramp the LR linearly back to the schedule's over this many steps after the conversion "
        "(recorded in the checkpoint's scheduler state).",
    )
    p.add_argument(
        "--target-share-pattern",
        default=DelinkOptions.share_pattern,
        help="none (the real model) or a pseudo pattern the source's refines, e.g. cycle:4 "
        "(progressive delinking: all -> cycle:K -> none).",
    )
    _add_target_flags(p)


def _copy_options(args) -> DelinkOptions:
    common = dict(
        optimizer_state=args.optimizer_state,
        noise_std=args.noise_std,
        noise_relative=args.noise_relative,
        lr_rewarmup_iters=args.lr_rewarmup_iters,
        share_pattern=args.target_share_pattern,
    )
    if args.command == "grow":
        return GrowOptions(**common, num_layers=args.num_layers, method=args.method)
    return DelinkOptions(**common)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2r-convert-checkpoint",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="Print the metadata and the table of tensors.")
    p.add_argument("dir")
    p.add_argument(
        "--verify",
        action="store_true",
        help="Also read every tensor and check it against its checksum in metadata.json.",
    )
    p = sub.add_parser("delink", help="Pseudo -> real (or a finer pattern): each layer gets its slot's weights.")
    _add_copy_flags(p)
    p = sub.add_parser("grow", help="L/k layers -> L layers by stacking or interleaving (not function-preserving).")
    p.add_argument("--num-layers", type=int, required=True, help="Layers of the grown model (a multiple k >= 2).")
    p.add_argument(
        "--method",
        choices=GROW_METHODS,
        default=GrowOptions.method,
        help="stack: layers 0..n-1 repeated k times (G_stack); interleave: each layer k times in place.",
    )
    _add_copy_flags(p)
    p = sub.add_parser("reshard", help="Change TP, PP (and stage split) or EP.")
    p.add_argument("src")
    p.add_argument("dst")
    _add_target_flags(p)
    p = sub.add_parser("export-hf", help="Write a Hugging Face transformers model directory (see docs/hf.md).")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--trim-vocab",
        action="store_true",
        help="Cut the padded vocabulary to the tokenizer's (default: keep it, the same function).",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="Dtype of the written weights."
    )
    p.add_argument("--max-shard-size", default="5GB", help="Split model.safetensors above this size (5GB, 500MiB).")
    p.add_argument(
        "--hf-architecture",
        choices=sorted(MODEL_TYPES),
        help="The HF class to write (default: the one the model's options point to; "
        "MistralForCausalLM only on request, since LlamaForCausalLM expresses the same models).",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="Load DST with transformers and compare its logits with ours (needs the [hf] extra).",
    )
    p.add_argument("--force", action="store_true", help="Replace a non-empty DST.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p = sub.add_parser(
        "import-hf", help="Read a Hugging Face GPT2/Llama/Mistral/Mixtral/Qwen2 directory into a checkpoint."
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        help="Our vocabulary padding (default: the largest power of two <= 128 dividing the HF vocabulary).",
    )
    _add_target_flags(p)
    p = sub.add_parser(
        "import-megatron",
        help="Read a Megatron-LM GPT/Llama/Mixtral checkpoint (torch_dist or "
        "legacy) into a checkpoint (see docs/megatron.md).",
    )
    p.add_argument("src")
    p.add_argument("dst")
    _add_target_flags(p)
    _add_export_megatron(sub)
    return parser


def _add_export_megatron(sub) -> None:
    p = sub.add_parser(
        "export-megatron",
        help="Write a Megatron-LM checkpoint (torch_dist or legacy) of a checkpoint (see docs/megatron.md).",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        default="torch_dist",
        help="Megatron's format: torch_dist (its default; loads into any TP/PP/EP) or torch (legacy "
        "mp_rank_* files for one layout).",
    )
    p.add_argument("--target-tensor-parallel-size", type=int, help="Megatron's TP (default: the source's).")
    p.add_argument(
        "--target-pipeline-parallel-size", type=int, help="Megatron's PP, layers split evenly (default: the source's)."
    )
    p.add_argument("--target-expert-parallel-size", type=int, help="Megatron's EP (default: the source's).")
    p.add_argument(
        "--dtype",
        choices=sorted(EXPORT_DTYPES),
        default="float32",
        help="Dtype of the written weights (bfloat16: for a --bf16 Megatron run, with the fp32 mains).",
    )
    p.add_argument(
        "--no-save-optim",
        action="store_true",
        help="Weights only: leave out Adam's state and the LR schedule's position (torch_dist).",
    )
    p.add_argument("--force", action="store_true", help="Replace a non-empty DST.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")


def _hf_command(args) -> int:
    if args.command == "export-hf":
        result = export_hf(
            args.src,
            args.dst,
            trim_vocab=args.trim_vocab,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            architecture=args.hf_architecture,
            force=args.force,
            progress=not args.no_progress,
        )
        print(
            f"wrote {result.architecture} to {args.dst} ({len(result.files)} weight file(s), vocab {result.vocab_size})"
        )
        for note in result.notes:
            print(f"  {note}")
        if args.verify:
            diff = verify_export(args.src, args.dst)
            if diff > VERIFY_TOLERANCE:
                print(
                    f"error: transformers' logits differ from ours by {diff:.3g} (> {VERIFY_TOLERANCE})",
                    file=sys.stderr,
                )
                return 3
            print(f"verified: transformers loads {args.dst}; max |logit difference| {diff:.3g}")
        return 0
    target = Target(
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.target_pipeline_layer_split,
        args.target_expert_parallel_size,
    )
    out, notes = import_hf(
        args.src,
        args.dst,
        target,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        force=args.force,
        progress=not args.no_progress,
    )
    print(f"wrote {out}")
    for note in notes:
        print(f"  {note}")
    return 0


def _megatron_command(args) -> int:
    if args.command == "export-megatron":
        out, notes = export_megatron(
            args.src,
            args.dst,
            ckpt_format=args.ckpt_format,
            tp=args.target_tensor_parallel_size,
            pp=args.target_pipeline_parallel_size,
            ep=args.target_expert_parallel_size,
            dtype=args.dtype,
            save_optim=not args.no_save_optim,
            force=args.force,
            progress=not args.no_progress,
        )
        print(f"wrote {out}")
        for note in notes:
            print(f"  {note}")
        return 0
    target = Target(
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.target_pipeline_layer_split,
        args.target_expert_parallel_size,
    )
    out, notes = import_megatron(args.src, args.dst, target, force=args.force, progress=not args.no_progress)
    print(f"wrote {out}")
    for note in notes:
        print(f"  {note}")
    return 0


def _run(args) -> int:
    if args.command == "inspect":
        print(inspect(args.dir, verify=args.verify))
        return 0
    if args.command in ("export-hf", "import-hf"):
        return _hf_command(args)
    if args.command in ("import-megatron", "export-megatron"):
        return _megatron_command(args)
    target = Target(
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.target_pipeline_layer_split,
        args.target_expert_parallel_size,
    )
    options = _copy_options(args) if args.command in ("delink", "grow") else None
    out = convert(args.src, args.dst, target, options, force=args.force, progress=not args.no_progress)
    print(f"wrote {out}; load it with --load {os.path.abspath(args.dst)}")
    if args.command == "grow":
        print(GROW_NOTE)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Exit status: 0 done, 2 bad input (one ``error:`` line), 1 an OS error, 3 --verify found a difference."""
    args = build_parser().parse_args(argv)
    return run_tool(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
