"""Optimizer, learning-rate schedule, loss scaling and CPU offload of optimizer state."""
