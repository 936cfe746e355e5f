"""transformers' ``rope_parameters`` of type ``yarn`` <-> our standard attention's YaRN options
(``--rope-type yarn``: model/yarn.py), for every rotary architecture that is not latent.

transformers' names: ``factor`` (--rotary-scaling-factor), ``original_max_position_embeddings``,
``beta_fast``, ``beta_slow``, ``truncate`` (--yarn-*), and the attention factor on the tables:
``attention_factor`` when given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
when both are given, else mscale(factor, 1) (``_compute_yarn_parameters``). Ours is always
mscale(factor, --mscale) / mscale(factor, --mscale-all-dim), megatron-core's concentration factor:
transformers' default is ours with --mscale 1 --mscale-all-dim 0, and an ``attention_factor`` a of
its own is --mscale (a - 1) / (0.1 ln factor) with --mscale-all-dim 0.
"""

from __future__ import annotations

import math

from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.model.yarn import yarn_concentration


def yarn_rope_parameters(m: ModelConfig) -> dict:
    """transformers' rope_parameters for ``m``'s YaRN (exactly its tables)."""
    out = {
        "rope_type": "yarn",
        "rope_theta": m.rotary_base,
        "factor": m.rotary_scaling_factor,
        "original_max_position_embeddings": m.yarn_original_max_position_embeddings,
        "beta_fast": m.yarn_beta_fast,
        "beta_slow": m.yarn_beta_slow,
        "truncate": m.yarn_correction_range_round_to_int,
    }
    if m.mscale and m.mscale_all_dim:
        return {**out, "mscale": m.mscale, "mscale_all_dim": m.mscale_all_dim}
    if m.mscale != 1.0 or m.mscale_all_dim:  # transformers would take mscale(factor, 1): give the value
        return {**out, "attention_factor": yarn_concentration(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim)}
    return out


def yarn_values(rope: dict, max_positions: int, where: str) -> dict:
    """{ModelConfig field: value} for transformers' yarn ``rope`` (``max_positions``: the config's
    max_position_embeddings, transformers' default original context), or an error naming the field."""
    original = int(rope.get("original_max_position_embeddings") or max_positions)
    factor = float(rope.get("factor") or max_positions / original)
    if factor < 1.0:
        raise HFConversionError(f"{where}: rope_parameters.factor {factor}: YaRN extends the context (>= 1)")
    values = dict(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )
    mscale, mscale_all_dim, given = rope.get("mscale"), rope.get("mscale_all_dim"), rope.get("attention_factor")
    if given is not None:
        if factor <= 1.0:
            if float(given) != 1.0:
                raise HFConversionError(
                    f"{where}: rope_parameters.attention_factor {given} with factor 1 has no equivalent here "
                    "(the tables are scaled by mscale ratios, 1 at factor 1)"
                )
            return values
        if float(given) < 1.0:
            raise HFConversionError(
                f"{where}: rope_parameters.attention_factor {given} < 1 has no equivalent here (mscale ratios >= 1)"
            )
        return dict(values, mscale=(float(given) - 1.0) / (0.1 * math.log(factor)), mscale_all_dim=0.0)
    if mscale and mscale_all_dim:
        return dict(values, mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
    return dict(values, mscale=1.0, mscale_all_dim=0.0)
