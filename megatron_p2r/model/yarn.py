"""YaRN rotary scaling (Peng et al. 2023), one implementation for standard attention
(``--rope-type yarn``, gpt-oss) and multi-latent attention (DeepSeek-V3), as megatron-core's
``YarnRotaryEmbedding`` and transformers' ``_compute_yarn_parameters`` compute it.

The frequencies: dimensions that turn many times over the original context keep their frequency
(extrapolated), slow ones are divided by ``factor`` (interpolated), and a linear ramp blends the
two between the correction range found from ``beta_fast`` and ``beta_slow`` rotations (rounded out
to whole dimensions unless told not to: gpt-oss does not). The tables are then multiplied by
the concentration ("attention") factor mscale(factor, mscale) / mscale(factor, mscale_all_dim),
which sharpens the softmax of every query/key product by its square.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scaling ``0.1 * mscale * ln(factor) + 1`` (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor on YaRN's cos/sin tables (megatron-core's ``_yarn_get_concentration_factor``;
    transformers' ``attention_factor``: with mscale 1 and mscale_all_dim 0, 0.1 ln(factor) + 1)."""
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def _correction_dim(rotations: float, dim: int, base: float, original_context: int) -> float:
    """The dimension whose frequency turns ``rotations`` times over the original context."""
    return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_context: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool,
    device=None,
) -> torch.Tensor:
    """YaRN's ``dim / 2`` inverse frequencies."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    extrapolated = 1.0 / (base**exponents)
    interpolated = 1.0 / (factor * base**exponents)
    low = _correction_dim(beta_fast, dim, base, original_context)
    high = _correction_dim(beta_slow, dim, base, original_context)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_tables(inv_freq: torch.Tensor, seq_len: int, concentration: float) -> tuple:
    """cos, sin [seq, 2 x len(inv_freq)] (rotate-half layout), both times ``concentration``."""
    positions = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    emb = torch.outer(positions, inv_freq).repeat(1, 2)
    return emb.cos() * concentration, emb.sin() * concentration
