"""Several ranks on the lane's device, against one process on CPU (same weights, same global
batch; fp32 tolerances of ``tests/cuda/compare.py``).

On one GPU: two data-parallel ranks with **gloo over CUDA tensors**, both on device 0 (NCCL
refuses two ranks on one GPU). It exercises the collectives gloo implements for CUDA tensors —
``all_reduce`` (gradient buckets, the gradient norm, the loss, the preflight's verdict) and
``broadcast`` — with the gradient buffers, the fused AdamW and the RNG on CUDA. What gloo does
not do on CUDA tensors — the distributed optimizer's reduce-scatter and all-gather, the MoE
all-to-alls (gloo's path here is send/recv), tensor-parallel collectives under NCCL's ordering —
needs NCCL and one GPU per rank: the ``nccl`` cases skip below 2 GPUs and run with
``python -m pytest tests/cuda/test_multirank.py -k nccl`` on a node with two or more.
"""

from tests.cuda.probe import dry_run, skip_without_cuda

skip_without_cuda()

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.config import validate  # noqa: E402
from tests.harness import run_distributed  # noqa: E402
from tests.cuda.compare import LOSS_FP32, assert_fp32_close, cpu_run, relative  # noqa: E402
from tests.cuda.workers import train_rank  # noqa: E402
from tests.helpers import TINY  # noqa: E402

pytestmark = pytest.mark.cuda

DP = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=512,
    micro_batch_size=2,
    global_batch_size=8,
    lr=1e-3,
    clip_grad=1.0,
    weight_decay=0.01,
)
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
# case: (the layout's flags, the model's and optimizer's flags, which the one-process reference shares)
NCCL_CASES = {
    "dp2-distributed-optimizer": (dict(use_distributed_optimizer=True), {}),
    "tp2-sequence-parallel": (dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "ep2-overlap-moe-comm": (dict(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True), MOE),
    "tp2-adafactor": (dict(tensor_model_parallel_size=2), dict(optimizer="adafactor")),
}
STEPS = 3


def checked(values: dict, world: int) -> dict:
    """The config validated for ``world`` ranks (a renamed flag fails here, in the dry run too)."""
    validate(config_from_values({**TINY, **values, "device": "cpu"}), world)
    return values


def test_dp2_gloo_over_cuda_tensors_on_one_gpu(record_property):
    values = checked({**DP, "distributed_backend": "gloo"}, 2)
    ref_losses, ref_grads, _ = cpu_run(DP, STEPS)
    if dry_run():
        pytest.skip("dry run on CPU: gloo over CUDA tensors needs CUDA (the CPU suite runs DP=2 on gloo)")
    ranks = run_distributed(train_rank, 2, values, STEPS, True, timeout=240)
    record_property("ranks", [(r["device"], r["backend"]) for r in ranks])
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert [(r["device"], r["backend"]) for r in ranks] == [("cuda:0", "gloo")] * 2
    assert_fp32_close(record_property, ranks[0]["losses"], ranks[0]["grads"], ref_losses, ref_grads)


@pytest.mark.parametrize("case", list(NCCL_CASES))
def test_nccl_two_gpus(record_property, case):
    """Layouts that need one GPU per rank: the losses of 3 steps against one process on CPU."""
    layout, model = NCCL_CASES[case]
    values = checked({**DP, **model, **layout}, 2)
    ref_losses, _, _ = cpu_run({**DP, **model}, STEPS)
    gpus = 0 if dry_run() else torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(
            f"needs 2 CUDA GPUs (have {gpus}): run `python -m pytest tests/cuda/test_multirank.py -k nccl` "
            "on a node with two or more"
        )
    ranks = run_distributed(train_rank, 2, values, STEPS, False, timeout=240, backend="nccl")
    losses = ranks[0]["losses"]
    record_property("loss_rel_err", relative(losses, ref_losses))
    assert max(relative(losses, ref_losses)) < LOSS_FP32, (losses, ref_losses)
