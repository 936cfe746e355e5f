"""Parallel building blocks: process groups, TP/EP collectives and layers, the vocabulary-parallel
loss, RNG streams, and data-parallel gradient reduction (DDP, gradient buffers, the norm)."""
