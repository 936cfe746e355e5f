"""Tensor-parallel building blocks: process groups, collectives, layers, loss, RNG."""
