"""megatron_p2r: Pseudo-to-Real pretraining of giant transformer LMs with TP/PP/EP/DP."""

__version__ = "0.1.0"
