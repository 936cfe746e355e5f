"""Import Megatron-LM checkpoints (GPT, Llama, Mixtral; torch_dist or the legacy layout; any
TP/PP/EP) into our format, without executing pickled code, and export ours to Megatron-LM
(docs/megatron.md).

    unpickler.py   allow-listed unpickling and streamed tensor records of torch.save files
    source.py      which checkpoint SRC names and its layout
    legacy.py      mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt files -> global tensors
    dist.py        torch_dist (.metadata + .distcp chunks) -> global tensors
    names.py       Megatron's tensor names and TP splits, one canonical name per tensor
    args.py        the saved args -> our model options, or the options that block it
    rules.py       our pieces <- Megatron tensors, and the inverse for export
    importer.py    the conversion (checked before writing, streamed piece by piece)
    export_args.py our model options -> the args Megatron saves, checked by reading them back
    writer.py      canonical tensors -> torch_dist (through DCP) or legacy files
    exporter.py    export-megatron
"""
