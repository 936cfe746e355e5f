"""Conversion: rewriting a checkpoint for another layout, phase or depth (reshard, delink, grow),
and importing from or exporting to Hugging Face transformers and Megatron-LM. Built on the
on-disk format of ``megatron_p2r.checkpoint``, which knows nothing of conversion."""
