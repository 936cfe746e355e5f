"""Training metrics: model FLOPs, memory, and the per-interval log line / JSONL / TensorBoard."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Optional

import torch

from megatron_p2r.config import ModelConfig


def model_flops_per_token(m: ModelConfig, recompute: bool = False) -> float:
    """Training FLOPs per token: 3x forward matmuls (4x with full recomputation).

    Forward = 2 x (matmul parameters a token touches: attention -- query, key/value (heads
    and query groups of --kv-channels each) and output projections --, dense or its top-k
    experts and shared experts, the router (and the shared experts' gate), the output layer) + causal attention scores and values, 2 x 2 x seq x (heads x
    kv-channels) per layer (counted over the full square, as Megatron does). Multi-token
    prediction adds per depth a layer of the last layer's kind, its 2h -> h projection and the
    output layer (Megatron-LM counts the same, and its norms).
    """
    h, L = m.hidden_size, m.num_layers
    ffn_mult = 3 if m.gated_linear_unit else 2
    attention = 2 * h * (m.num_attention_heads + m.query_groups) * m.head_dim
    core = 4 * m.seq_length * m.num_attention_heads * m.head_dim
    if m.multi_latent_attention:  # down-, up- and output projections; scores over q/k, values over v dims
        heads = m.num_attention_heads
        query = heads * m.q_head_dim * (h if m.q_lora_rank is None else m.q_lora_rank) + h * (m.q_lora_rank or 0)
        keys_values = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * heads * (
            m.qk_head_dim + m.v_head_dim
        )
        attention = query + keys_values + heads * m.v_head_dim * h
        core = 2 * m.seq_length * heads * (m.q_head_dim + m.v_head_dim)
    dense = ffn_mult * h * m.ffn_size
    expert = (
        ffn_mult * h * m.expert_ffn_size * (m.moe_num_prototypes if m.moe_num_prototypes > 1 else m.moe_router_topk)
    )
    expert += ffn_mult * h * m.shared_expert_ffn_size  # shared experts: every token
    router = h * ((m.num_experts or 0) + (1 if m.moe_shared_expert_gate and m.shared_expert_ffn_size else 0))
    per_layer = [attention + ((expert + router) if m.is_moe_layer(i) else dense) for i in range(L)]
    vocab = m.padded_vocab_size if m.vocab_size else 0
    forward = 2 * (sum(per_layer) + h * vocab) + core * L
    depths = m.mtp_num_layers or 0  # each: a layer of the last one's kind, 2h -> h, the output layer
    mtp = depths * (2 * (per_layer[-1] + 2 * h * h + h * vocab) + core)
    return forward * (4 if recompute else 3) + 3 * mtp  # the MTP depths are never recomputed


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib * (1 if sys.platform == "darwin" else 1024)


class TrainingLogger:
    """Prints a human line and writes the same scalars as JSONL, to TensorBoard and to W&B."""

    def __init__(
        self, log_file: Optional[str] = None, tensorboard_dir: Optional[str] = None, enabled: bool = True, wandb=None
    ):
        self.enabled = enabled
        self.wandb = wandb  # a wandb_writer.WandbWriter: the same records as W&B history rows
        self.log_file = log_file if enabled else None
        self.writer = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)
        if self.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def log(self, record: dict, line: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        if self.log_file:
            with open(self.log_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("iteration", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def scalars(self, values: dict, iteration: int, consumed_samples: int) -> None:
        """TensorBoard points under Megatron-LM's tags, each but the memory ones also against the
        consumed samples ("TAG vs samples"), as Megatron's ``training_log`` writes them."""
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, iteration)
            if not tag.startswith("mem-"):
                self.writer.add_scalar(f"{tag} vs samples", value, consumed_samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


def format_line(r: dict) -> str:
    parts = [
        f"iteration {r['iteration']:>6d}/{r['train_iters']:>6d}",
        f"consumed samples {r['consumed_samples']}",
        f"global batch size {r['global_batch_size']}",
        f"ms/iter {r['ms_per_iter']:.1f}",
        f"lr {r['lr']:.3E}",
        f"lm loss {r['lm_loss']:.4E}",
        f"grad norm {r['grad_norm']:.3f}",
        f"tokens/s {r['tokens_per_s']:.0f}",
        f"TFLOP/s per rank {r['tflops']:.3f}",
        f"peak mem {r['peak_memory_gib']:.2f} GiB",
    ]
    if r.get("num_zeros_in_grad") is not None:
        parts.append(f"num zeros {r['num_zeros_in_grad']}")
    if r.get("params_norm") is not None:
        parts.append(f"params norm {r['params_norm']:.3f}")
    if r.get("loss_scale", 1.0) != 1.0:
        parts.append(f"loss scale {r['loss_scale']:.1f}")
    if r.get("skipped"):
        parts.append(f"skipped {r['skipped']}")
    parts += [f"{key} {r[key]:.4E}" for key in sorted(r) if key.startswith("mtp_") and key.endswith(" loss")]
    for key in ("moe_dropped_fraction", "moe_min_load", "moe_max_load"):
        if key in r:
            parts.append(f"{key.replace('_', ' ')} {r[key]:.3f}")
    return " | ".join(parts)
