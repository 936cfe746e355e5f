"""Checkpoints: the on-disk format, collective save and load, crash recovery of a save directory,
resharding and delinking, and conversion to and from Hugging Face transformers."""
