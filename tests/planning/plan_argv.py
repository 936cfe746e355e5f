"""Planner command lines (``tools/plan.py``) that the planning and tool tests share."""

# The M6-10T example on 512 V100s; tests add --token-budget, --json and what they vary.
TEN_T = (
    "--config examples/m6_10t/model.yaml --pseudo-config examples/m6_10t/pseudo.yaml "
    "--real-config examples/m6_10t/real.yaml --world-size 512 --gpu V100-32GB"
).split()
# A small model's real phase: the shape of every small planner test.
SHAPE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 256 --p2r-phase real".split()
)
# Two pipeline stages, each offloading a layer (fp16 weights: AdamW steps fp32 mains, rounds fp16
# weights), on 12 GPUs: a full node of 8 and a node of 4.
OFFLOADED = (
    SHAPE + "--cpu-offload-layers 2 --fp16 --pipeline-model-parallel-size 2 --world-size 12 --gpu V100-32GB".split()
)
