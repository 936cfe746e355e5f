"""DeepSeek-style MoE (sigmoid scores, group-limited and scaled top-k, the expert bias, the
per-sequence aux loss, gated shared experts, an MoE multi-token prediction depth whose router's
bias is updated as the decoder's) under EP2 (with the overlapped all-to-alls, the shared
experts overlapped with the dispatch and --moe-grouped-gemm; and serial with the distributed
optimizer), TP2 with sequence parallelism and PP2 in the pseudo phase (one slot, and its bias,
shared by both stages; the MTP depth on the last stage only), against the one-process run: 3 steps' losses and grad norms, the first
step's gradients, the weights after 3 steps, and the expert biases after 3 steps — bitwise equal
(they are sums of +-rate steps: equal biases mean every routing decision and count agreed).

Tolerances (fp32): losses, grad norms and gradients within 1e-5, weights after 3 steps within 5e-5
(AdamW at lr 1e-2 normalises the gradients, amplifying their rounding: observed 2.6e-5 under TP2
with the MTP depth; see docs/evidence/moe.md and docs/evidence/mtp.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_p2r.checkpoint.expert_bias import FIELD as EXPERT_BIAS
from megatron_p2r.checkpoint.expert_bias import bias_name, mtp_bias_name
from megatron_p2r.checkpoint.io import load_checkpoint
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.training import build_train_state

from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.helpers import keep_first_step_grads, random_microbatches, reference_config, run_steps
from tests.moe.deepseek_workers import CASES, biases, case_config, world2

TOL = 1e-5
WEIGHT_TOL = 5e-5


def _reference(label: str) -> dict:
    cfg = reference_config(case_config(label)).replace(
        moe_shared_expert_overlap=False, overlap_moe_expert_parallel_comm=False, use_distributed_optimizer=False
    )
    grads, records = {}, []
    losses, state = run_steps(cfg, ParallelState.single(), 3, after_step=keep_first_step_grads(grads), outputs=records)
    return {
        "losses": losses,
        "grad_norms": [r["grad_norm"] for r in records],
        "grads": grads,
        "weights": {n: p.detach().float().clone() for n, p in state.model.named_parameters()},
        "biases": biases(state.model),
    }


@pytest.fixture(scope="module")
def deepseek_world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("deepseek"))
    references = {label: _reference(label) for label in CASES}
    path = os.path.join(root, "references.pt")  # a file: passed as arguments, its tensors exceed the fds a fork sends
    torch.save(references, path)
    return run_distributed(world2, 2, path, root, timeout=600), root, references


@pytest.mark.parametrize("label", list(CASES))
def test_matches_one_process(deepseek_world2, label):
    results = deepseek_world2[0]
    held, biased = set(), set()
    for rank, res in enumerate(results):
        r = res[label]
        assert r["loss_err"] <= TOL, f"{label} rank {rank}: loss differs by {r['loss_err']}"
        assert r["norm_err"] <= TOL, f"{label} rank {rank}: grad norm differs by {r['norm_err']}"
        assert r["grad_err"] <= TOL, f"{label} rank {rank}: gradient differs by {r['grad_err']}"
        assert r["weight_err"] <= WEIGHT_TOL, f"{label} rank {rank}: weights differ by {r['weight_err']}"
        assert r["bias_moved"], f"{label} rank {rank}: an expert bias did not move"
        assert r["bias_equal"], f"{label} rank {rank}: expert bias differs from the one-process run's"
        held.update(r["names"])
        biased.update(r["bias_keys"])
    assert biased == {bias_name(0), bias_name(1), mtp_bias_name(0)} - ({bias_name(1)} if "pseudo" in label else set())
    assert any(".mlp.shared_experts.gate_weight" in n for n in held)
    assert any(".mlp.shared_experts.fc1.weight" in n for n in held)


def test_shared_experts_do_not_go_through_the_dispatcher(deepseek_world2):
    """Each routed assignment crosses the all-to-alls four times (dispatch, combine and their
    reverses in backward); the shared experts' tokens never do."""
    results = deepseek_world2[0]
    sent = sum(res["rows"]["sent"] for res in results)
    assert sent == 4 * sum(res["rows"]["assignments"] for res in results)


def _saved_biases(path: str) -> dict:
    return read_metadata(resolve_iteration_dir(path))[EXPERT_BIAS]


def _loaded(cfg, path: str):
    """A one-process train state of ``cfg`` loaded from ``path``."""
    state = build_train_state(cfg, ParallelState.single())
    load_checkpoint(path, state)
    return state


def test_expert_bias_is_saved_resharded_and_loaded(deepseek_world2, tmp_path):
    """The EP2 run's biases after 3 steps (the decoder's and the MTP depth's) are in its
    checkpoint, survive EP2 -> EP1 -> EP2, and an EP1 run loads them exactly."""
    _, root, references = deepseek_world2
    label = "ep2-serial-distopt"
    want = {name: v.tolist() for name, v in references[label]["biases"].items()}
    assert mtp_bias_name(0) in want
    saved = _saved_biases(os.path.join(root, label))
    assert saved == want
    convert(os.path.join(root, label), str(tmp_path / "ep1"), Target(expert_parallel_size=1), progress=False)
    convert(str(tmp_path / "ep1"), str(tmp_path / "ep2"), Target(expert_parallel_size=2), progress=False)
    assert _saved_biases(str(tmp_path / "ep1")) == want == _saved_biases(str(tmp_path / "ep2"))
    cfg = reference_config(case_config(label)).replace(use_distributed_optimizer=False, moe_shared_expert_overlap=False)
    state = _loaded(cfg, str(tmp_path / "ep1"))
    for key, bias in biases(state.model).items():
        assert torch.equal(bias, references[label]["biases"][key])


def test_delinked_layers_each_get_the_slot_bias(deepseek_world2, tmp_path):
    """A pseudo slot's bias goes to every real layer that called it, the MTP depth's (no shared
    slot) is copied as it is, and the real model computes the pseudo model's loss (routing
    included)."""
    _, root, references = deepseek_world2
    pseudo = os.path.join(root, "pp2-pseudo")
    slot, depth = (references["pp2-pseudo"]["biases"][n] for n in (bias_name(0), mtp_bias_name(0)))
    convert(pseudo, str(tmp_path / "real"), Target(pipeline_parallel_size=1), DelinkOptions(), progress=False)
    want = {bias_name(0): slot.tolist(), bias_name(1): slot.tolist(), mtp_bias_name(0): depth.tolist()}
    assert _saved_biases(str(tmp_path / "real")) == want
    convert(pseudo, str(tmp_path / "pp1"), Target(pipeline_parallel_size=1), progress=False)
    pseudo_cfg = reference_config(case_config("pp2-pseudo"))
    real = _loaded(pseudo_cfg.replace(p2r_phase="real", share_pattern="none"), str(tmp_path / "real"))
    assert {n: b.tolist() for n, b in biases(real.model).items()} == want
    one = _loaded(pseudo_cfg, str(tmp_path / "pp1"))
    batch = random_microbatches(pseudo_cfg, 1, 2, seed=5)[0]
    with torch.no_grad():
        losses = [
            state.model.eval()(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"]).mean()
            for state in (real, one)
        ]
    assert losses[0].item() == losses[1].item()
