"""The planner's activation model (its CUDA variant, as ``tools/plan.py --json`` reports it for
one stage with one micro-batch in flight) against the CUDA caching allocator, for 7 shapes:
one forward + backward of one micro-batch.

Measured after a warm-up step, so the gradients already exist (backward accumulates into them)
and cuBLAS workspaces and kernel choices are settled; ``held`` is what is allocated at the end
of the forward (run as training runs it: in the weights' dtype, no autocast), ``peak`` the
maximum over forward and backward, both beyond the mark. Both within 10% of the planner's
``activations`` and ``activations + transient``.
"""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402

from megatron_p2r.model.m6 import build_model  # noqa: E402
from tests.cuda.lane import planned_stage  # noqa: E402
from tests.helpers import random_microbatches  # noqa: E402

pytestmark = pytest.mark.cuda

GPU = dict(
    num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000, micro_batch_size=4
)
CPU = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256, micro_batch_size=2)
CASES = {
    "fp32": dict(),
    "bf16": dict(bf16=True),
    "bf16_recompute": dict(bf16=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "bf16_swiglu_rope_rmsnorm_untied": dict(
        bf16=True,
        swiglu=True,
        position_embedding_type="rope",
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
    ),
    "bf16_dropout": dict(bf16=True, hidden_dropout=0.1, attention_dropout=0.1),
    "bf16_mla": dict(
        bf16=True,
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        position_embedding_type="rope",
    ),
    # capacity 0.5 fills every expert (the planner assumes balanced routing)
    "bf16_moe_top2": dict(
        bf16=True, num_experts=8, moe_router_topk=2, moe_capacity_factor=0.5, moe_layer_freq=2, moe_z_loss_coeff=0.01
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_activation_estimate_matches_cuda_allocator(lane, record_property, case):
    cfg = lane.config(CASES[case], gpu=GPU, cpu=CPU)
    model = build_model(cfg, lane.parallel(cfg))
    batch = {k: v.to(lane.device) for k, v in random_microbatches(cfg, 1, cfg.train.micro_batch_size)[0].items()}

    def forward_backward(after_forward=lambda: None):
        loss = model(tokens=batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
        after_forward()
        loss.backward()

    forward_backward()  # warm-up
    est = planned_stage(cfg)["device"]
    est_held = est["activations"]
    est_peak = est_held + est["transient"]
    mark = lane.mark()
    held = []
    forward_backward(lambda: held.append(lane.allocated_since(mark)))
    peak = lane.peak_since(mark)
    record_property("held", {"measured": held[0], "planned": est_held, "ratio": round(held[0] / est_held, 4)})
    record_property("peak", {"measured": peak, "planned": est_peak, "ratio": round(peak / est_peak, 4)})
    assert abs(peak / est_peak - 1) < 0.10, (peak, est)
    assert abs(held[0] / est_held - 1) < 0.10, (held[0], est)
