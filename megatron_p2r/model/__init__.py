"""The M6 decoder-only language model, built from tensor-parallel parts, one pipeline stage at a time."""
