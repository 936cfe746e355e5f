"""Data: tokenizers, Megatron-format indexed datasets, GPT samples, blending, samplers."""
