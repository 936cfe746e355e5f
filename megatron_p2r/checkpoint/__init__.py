"""Checkpoints: the on-disk format (naming, tensor table, safetensors I/O, metadata, integrity),
one writer per directory (lock, staging, atomic writes), collective save and load, and crash
recovery of a save directory. Conversion between formats and layouts is ``megatron_p2r.convert``."""
