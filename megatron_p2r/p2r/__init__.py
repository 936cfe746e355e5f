"""Pseudo-to-Real: layer->slot sharing maps (pseudo phase) and delinking (pseudo -> real)."""
