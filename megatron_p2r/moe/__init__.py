"""Mixture of experts: routers, token dispatch over expert parallelism, stacked experts, the MoE layer."""
