"""transformers' ``rope_parameters`` <-> our rotary scaling flags, one dict of them (a whole model's,
or one Gemma 3 layer type's): default, Llama 3.1's "llama3" with megatron-core's fixed parameters
(--use-rope-scaling --rope-scaling-factor) and "linear" position interpolation with an integer
factor (--rotary-seq-len-interpolation-factor, Megatron-LM's type); "yarn" as --rope-type yarn
(convert/hf/yarn.py). transformers' linear divides
inv_freq by the factor and scales no attention (its attention factor is 1), which is Megatron-LM's
positions divided by the factor."""

from __future__ import annotations

from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.yarn import yarn_rope_parameters, yarn_values

# megatron-core's fixed Llama 3.1 scaling parameters (RotaryEmbedding._apply_scaling)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' rope_parameters of ``m``'s (scaled) rotary; llama3 and linear at once is an
    export blocker (architecture.py)."""
    if m.yarn:
        return yarn_rope_parameters(m)
    if m.use_rope_scaling:
        return {"rope_type": "llama3", "rope_theta": m.rotary_base, "factor": m.rope_scaling_factor, **LLAMA3_ROPE}
    if m.rotary_seq_len_interpolation_factor is not None:
        return {
            "rope_type": "linear",
            "rope_theta": m.rotary_base,
            "factor": float(m.rotary_seq_len_interpolation_factor),
        }
    return {"rope_type": "default", "rope_theta": m.rotary_base}


def rope_type(rope: dict) -> str:
    """The type of a rope_parameters / rope_scaling dict (``type``: transformers 4's older key)."""
    return rope.get("rope_type", rope.get("type", "default"))


def rope_scaling_values(rope: dict, where: str, max_positions: int = 4096) -> dict:
    """--use-rope-scaling / --rotary-seq-len-interpolation-factor for transformers' "llama3" (with
    megatron-core's fixed parameters) and "linear" (an integer factor, Megatron-LM's type);
    --rope-type yarn and its options for "yarn" (``max_positions``: transformers' default original
    context, the config's max_position_embeddings)."""
    kind = rope_type(rope)
    if kind == "yarn":
        return yarn_values(rope, max_positions, where)
    if kind == "llama3" and all(float(rope.get(k, -1)) == v for k, v in LLAMA3_ROPE.items()):
        return dict(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    if kind == "linear" and float(rope.get("factor", 0)).is_integer() and rope["factor"] > 0:
        return dict(rotary_seq_len_interpolation_factor=int(rope["factor"]))
    if kind != "default":
        raise HFConversionError(
            f"{where}: rope type {kind!r} with {rope} has no equivalent here (Llama 3.1's "
            f"with {LLAMA3_ROPE}, linear with an integer factor, and yarn have)"
        )
    return {}
