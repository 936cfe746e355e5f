"""Export our checkpoints to Hugging Face transformers, and import HF models back (docs/hf.md).

Which HF architecture a model becomes is decided by its options (``architecture.py``):

    learned positions, LayerNorm, GELU, dense         -> GPT2LMHeadModel
    rotary, RMSNorm, SwiGLU, dense                     -> LlamaForCausalLM
    rotary, RMSNorm, SwiGLU, top-k MoE in every layer  -> MixtralForCausalLM

Anything else is an ``HFConversionError`` that names every option blocking it.

The mapping (``rules.py``) is a list of ``Rule`` objects, one per piece of ours (a logical
tensor, or one expert), each with pure tensor functions both ways.

Vocabulary: by default the HF model keeps our padded vocabulary (``vocab_size`` = padded
size), so it is the same function as ours (same logits, same loss, same greedy choices); the
tokenizer simply never emits the padding ids. ``trim_vocab`` cuts the rows to the
tokenizer's vocabulary instead (logits on real ids unchanged; the softmax no longer includes
the padding ids). Import picks ``--make-vocab-size-divisible-by`` so that our padded size
equals the HF vocabulary whenever TP allows (then nothing is padded and the function is
exact); otherwise the extra rows are zeros.

Both directions stream: export (``exporter.py``) reads one piece of ours (concatenating its
TP shards, delinking a pseudo checkpoint on the fly), converts it and appends the result to
the current safetensors shard (headers are planned first from shapes alone, so nothing else
is held); import (``importer.py``) reads the HF tensors of one piece of ours and writes its TP
shards. transformers is needed only by ``verify.verify_export``.
"""
