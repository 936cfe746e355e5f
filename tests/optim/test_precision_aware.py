"""The precision-aware optimizer (16-bit AdamW moments, bf16 main gradients, fp16 main
parameters): the flags' rules, state stored in its dtype, the same setting on DP2 + distributed
optimizer, TP2, PP2 + offload and staged moments reproducing one process, fp16 loss scaling over
bf16 gradients, checkpoints across settings, bitwise resume, and the planner's bytes equal to
what a rank allocates."""

from __future__ import annotations


import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.config import ConfigError
from megatron_p2r.optim import precision_aware
from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.estimate import make_plan
from megatron_p2r.planning.hardware import GPU_PRESETS
from megatron_p2r.planning.memory import stage_state_bytes
from tests.harness import run_distributed
from megatron_p2r.training import build_train_state, describe_memory, setup_parallel
from tests.helpers import run_steps
from tests.optim.common import DISTOPT, OVERLAP, cfg, fake_world
from tests.optim.workers import equivalence_cases

PA = dict(use_precision_aware_optimizer=True)
LEAN = dict(exp_avg_dtype="fp16", exp_avg_sq_dtype="bf16", **PA)
GRADS16 = dict(main_grads_dtype="bf16", **PA)
MAINS16 = dict(main_params_dtype="fp16", **PA)  # needs 16-bit weights
PSEUDO = dict(num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2")
RESUME = dict(lr_warmup_iters=1, lr_decay_style="cosine", clip_grad=1.0, weight_decay=0.01, train_iters=4)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(exp_avg_dtype="bf16"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype="fp8"), "--exp-avg-sq-dtype fp8 is not built"),
        (dict(main_grads_dtype="bf16"), "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
        (MAINS16, "--main-params-dtype fp16 needs 16-bit weights"),
        (dict(bf16=True, optimizer="lion", **MAINS16), "--main-params-dtype fp16 is built for --optimizer adam only"),
    ],
)
def test_dtype_flags_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**flags).train.check()


def _moments(state):
    return [s for inner in state.optimizer.inner.values() for s in inner.state.values()]


@pytest.mark.parametrize("weights", [{}, dict(bf16=True), dict(fp16=True)], ids=["fp32", "bf16", "fp16"])
def test_moments_are_stored_in_their_dtype_and_track_fp32_adamw(weights):
    """3 steps: every moment in its flag's dtype (fp16 weights: with loss scaling), the losses
    those of fp32 moments to 1e-4 relative."""
    fp32, _ = run_steps(cfg(**weights), ParallelState.single(), 3)
    lean, state = run_steps(cfg(**weights, **LEAN), ParallelState.single(), 3)
    states = _moments(state)
    assert states and all(
        s["exp_avg"].dtype == torch.float16 and s["exp_avg_sq"].dtype == torch.bfloat16 for s in states
    )
    assert lean == pytest.approx(fp32, rel=1e-4) and lean != fp32


@pytest.mark.parametrize(
    "weights,flags",
    [
        ({}, GRADS16),
        (dict(bf16=True), GRADS16),
        (dict(fp16=True), GRADS16),
        (dict(bf16=True), MAINS16),
        (dict(fp16=True), MAINS16),
    ],
    ids=["fp32-grads16", "bf16-grads16", "fp16-grads16", "bf16-mains16", "fp16-mains16"],
)
def test_main_grads_and_params_are_stored_in_their_dtype(weights, flags):
    """3 steps: bf16 gradient buffers (every main gradient a view of them), fp16 mains — copies
    of bf16 weights, the fp16 weights themselves (no second copy); the losses those of fp32
    main gradients and parameters to 1e-4 relative (2.6e-5 observed), not equal."""
    fp32, _ = run_steps(cfg(**weights), ParallelState.single(), 3)
    lean, state = run_steps(cfg(**weights, **flags), ParallelState.single(), 3)
    grads = state.ddp.buffer_tensors("grads")
    want_grad = torch.bfloat16 if flags is GRADS16 else torch.float32
    assert grads and all(t.dtype == want_grad for t in grads)
    shards = state.optimizer.shards
    assert all(ms.grad.dtype == want_grad for ms in shards)
    if flags is MAINS16:
        assert all(ms.main.dtype == torch.float16 for ms in shards)
        aliased = [ms.main.data_ptr() == ms.param.data_ptr() for ms in shards]
        assert all(aliased) if weights.get("fp16") else not any(aliased)
    assert lean == pytest.approx(fp32, rel=1e-4) and lean != fp32


def test_fp16_loss_scaling_over_bf16_main_grads_skips_and_unscales_as_over_fp32():
    """fp16 weights from a loss scale of 2^24: the scaled fp16 gradients overflow, the bf16
    buffers hold the infs, so the same steps are skipped and the scale halves alike as with
    fp32 main gradients; the steps taken have the same (unscaled) gradient norms to 1e-2
    relative (bf16 gradients: 8 bits of mantissa)."""
    runs = {}
    for name, flags in (("fp32", {}), ("bf16", GRADS16)):
        outputs = []
        _, state = run_steps(
            cfg(fp16=True, initial_loss_scale=2.0**24, **flags), ParallelState.single(), 10, outputs=outputs
        )
        runs[name] = ([o["skipped"] for o in outputs], [o["grad_norm"] for o in outputs], state.scaler.scale)
    (skipped, norms, scale), (skipped16, norms16, scale16) = runs["fp32"], runs["bf16"]
    assert skipped == skipped16 and scale == scale16
    assert any(skipped) and not all(skipped)
    taken = [i for i, s in enumerate(skipped) if not s]
    assert [norms16[i] for i in taken] == pytest.approx([norms[i] for i in taken], rel=1e-2)


def _weights(state):
    state.ddp.finish_param_sync()
    return [p.detach().clone() for _, p in sorted(state.model.named_parameters())]


def _resume_and_cross_load(tmp_path, lean, plain) -> tuple:
    """Both settings saved after 2 of 4 steps; ``lean`` resumed from its checkpoint must give
    the last 2 losses and the weights of its uninterrupted run bitwise. Returns the states of
    (lean from lean, plain from lean, lean from plain, plain from plain), loaded, not stepped."""
    single = ParallelState.single()
    whole = {}
    for c, name in ((lean, "lean"), (plain, "plain")):

        def save_after_2(s, where=str(tmp_path / name)) -> None:
            if s.iteration == 2:
                save_checkpoint(where, s)

        whole[name] = run_steps(c, single, 4, after_step=save_after_2)
    resumed, again = run_steps(lean, single, 2, load=str(tmp_path / "lean"))
    losses, state = whole["lean"]
    assert resumed == losses[2:]
    assert all(torch.equal(a, b) for a, b in zip(_weights(again), _weights(state), strict=True))
    return tuple(
        run_steps(c, single, 0, load=str(tmp_path / saved))[1]
        for c, saved in ((lean, "lean"), (plain, "lean"), (lean, "plain"), (plain, "plain"))
    )


def test_checkpoints_move_between_settings_and_resume_bitwise(tmp_path):
    """Saved after 2 of 4 steps with 16-bit moments: resumed with the same setting, the last 2
    losses and the weights are bitwise the uninterrupted run's; loaded with fp32 AdamW the
    moments are the exact upcasts. Saved with fp32 AdamW and loaded lean: the moments are
    rounded to nearest."""
    states = _resume_and_cross_load(tmp_path, cfg(**LEAN, **RESUME), cfg(**RESUME))
    for a, b, c16, c32 in zip(*(_moments(s) for s in states), strict=True):
        for k in ("exp_avg", "exp_avg_sq"):
            assert b[k].dtype == torch.float32 and torch.equal(b[k], a[k].float())
            assert c16[k].dtype == a[k].dtype and torch.equal(c16[k], c32[k].to(a[k].dtype))


def _mains(state):
    return [ms.main.detach().clone() for ms in state.optimizer.shards]


@pytest.mark.parametrize(
    "weights,flags",
    [({}, GRADS16), (dict(bf16=True), MAINS16), (dict(fp16=True), MAINS16)],
    ids=["fp32-grads16", "bf16-mains16", "fp16-mains16"],
)
def test_main_dtypes_move_between_settings_and_resume_bitwise(tmp_path, weights, flags):
    """Saved after 2 of 4 steps with bf16 main gradients or fp16 mains: resumed with the same
    setting, the last 2 losses and the weights are bitwise the uninterrupted run's. Loaded with
    fp32 main gradients and parameters, the mains are the exact upcasts of the fp16 ones (the
    moments too: fp32 on both sides); saved with fp32 and loaded with fp16 mains, they are the
    fp32 mains rounded to nearest. Gradients are not state: a step starts from zeroed buffers."""
    states = _resume_and_cross_load(tmp_path, cfg(**weights, **flags, **RESUME), cfg(**weights, **RESUME))
    for a, b, c16, c32 in zip(*(_mains(s) for s in states), strict=True):
        assert b.dtype == c32.dtype and torch.equal(b, a.to(b.dtype))
        assert c16.dtype == a.dtype and torch.equal(c16, c32.to(a.dtype))
    for a, b in zip(_moments(states[0]), _moments(states[1]), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))


CASES = {
    "dp2-distopt": dict(**OVERLAP, **LEAN),
    "tp2": dict(tensor_model_parallel_size=2, **LEAN),
    "pp2-pseudo-offload": dict(pipeline_model_parallel_size=2, cpu_offload_layers="1", **PSEUDO, **LEAN),
    "dp2-distopt-staged-moments": dict(cpu_offload_layers="1", cpu_offload_what="optimizer", **OVERLAP, **LEAN),
}
FP16_WEIGHTS = {"lean": dict(fp16=True, **DISTOPT, **LEAN), "fp32-moments": dict(fp16=True, **DISTOPT)}
LAYOUTS = {
    "dp2-distopt": OVERLAP,
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2-pseudo-offload": dict(pipeline_model_parallel_size=2, cpu_offload_layers="1", **PSEUDO),
}
# bf16 main gradients (fp32 weights), fp16 mains (bf16 weights; fp16 weights: the mains are the weights)
MAIN_DTYPES = {
    **{f"{k}-grads16": dict(**v, **GRADS16) for k, v in LAYOUTS.items()},
    **{f"{k}-mains16": dict(bf16=True, **v, **MAINS16) for k, v in LAYOUTS.items()},
    "dp2-distopt-staged-grads16": dict(cpu_offload_layers="1", cpu_offload_what="optimizer", **OVERLAP, **GRADS16),
    # real_lean.yaml's kind: Adafactor, host-resident layers stepped by the overlapped host step
    "dp2-adafactor-host-step-grads16": dict(
        optimizer="adafactor", cpu_offload_layers="1", overlap_cpu_optimizer_d2h_h2d=True, **GRADS16
    ),
    "dp2-distopt-fp16-weights-grads16": dict(fp16=True, **DISTOPT, **GRADS16),
    "dp2-distopt-fp16-weights-mains16": dict(fp16=True, **DISTOPT, **MAINS16),
}


def test_each_layout_reproduces_one_process_with_the_same_setting():
    """3 steps, gradients clipped: losses and gradient norms 1e-5 relative, weights 1e-4. fp16
    weights (loss scaling) round each update to fp16, so DP2's reduction order moves a weight by
    an fp16 ulp: there the weights differ by at most twice what they do with fp32 moments (3.9e-3
    observed; 5.6e-3 lean) and the third norm by 5e-5 (1.4e-5 observed).

    bf16 main gradients and bf16 weights (under fp16 mains) round what DP2, TP2 and PP2 sum in
    another order than one process does — the micro-batches' bf16 accumulation and reduction,
    the bf16 forward's partial products — so there the losses agree to 5e-4 relative (1.4e-4
    observed, as large as bf16 weights with fp32 mains give) and the gradient norms to 1e-2
    (bf16's 8-bit mantissa; 3.7e-3 observed) — bf16 gradients with staged moments and with
    Adafactor's host-resident layers stepped by the overlapped host step (real_lean.yaml's kind)
    included; fp16 weights with fp16 mains (no copy) keep the fp16-weights bound on their weights."""
    cases = {**CASES, **{f"fp16-weights-{k}": v for k, v in FP16_WEIGHTS.items()}, **MAIN_DTYPES}
    for rank, res in enumerate(run_distributed(equivalence_cases, 2, cases, timeout=600)):
        for label in CASES:
            r = res[label]
            assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), (label, rank, r)
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (label, rank, r)
            assert r["weight_err"] < 1e-4, (label, rank, r["weight_err"])
        r, fp32_moments = res["fp16-weights-lean"], res["fp16-weights-fp32-moments"]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), (rank, r)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=5e-5), (rank, r)
        assert r["weight_err"] <= 2 * fp32_moments["weight_err"], (rank, r, fp32_moments)
        for label in MAIN_DTYPES:
            r = res[label]
            assert r["losses"] == pytest.approx(r["ref"], rel=5e-4), (label, rank, r)
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-2), (label, rank, r)
        aliased = res["dp2-distopt-fp16-weights-mains16"]
        assert aliased["weight_err"] <= 2 * fp32_moments["weight_err"], (rank, aliased, fp32_moments)


MEASURED = [  # label, world, rank, flags
    (
        "dp2-bf16-distopt-lean",
        2,
        1,
        dict(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", **DISTOPT),
    ),
    ("pp2-fp32-offload-lean", 2, 1, dict(pipeline_model_parallel_size=2, cpu_offload_layers="1", **PSEUDO, **LEAN)),
    ("fp16-one-moment-lean", 1, 0, dict(fp16=True, use_precision_aware_optimizer=True, exp_avg_dtype="fp16")),
    ("dp2-bf16-distopt-grads16-mains16", 2, 1, dict(bf16=True, **DISTOPT, **GRADS16, main_params_dtype="fp16")),
    (
        "pp2-fp32-offload-grads16",
        2,
        1,
        dict(pipeline_model_parallel_size=2, cpu_offload_layers="1", **PSEUDO, **GRADS16),
    ),
    ("fp16-mains16-no-copy", 1, 0, dict(fp16=True, **MAINS16)),
    (
        "lion-grads16-staged",
        1,
        0,
        dict(optimizer="lion", cpu_offload_layers="1", cpu_offload_what="optimizer", **GRADS16),
    ),
]


@pytest.mark.parametrize("label,world,rank,flags", MEASURED, ids=[m[0] for m in MEASURED])
def test_bytes_a_rank_holds_are_the_planners(label, world, rank, flags):
    c = cfg(**flags)
    with fake_world(world, rank):
        ps, plan = setup_parallel(c, torch.device("cpu"))
        state = build_train_state(c, ps, plan)
        state.optimizer.prepare_grads()
        state.optimizer.step()
        measured = describe_memory(state)
    planned = stage_state_bytes(plan, ps.pp_rank, ps.coords)
    assert measured["optimizer_bytes"] == planned["optimizer"] > 0
    assert (measured["param_bytes"], measured["grad_bytes"]) == (planned["params"], planned["grads"])


def test_planner_times_the_bytes_the_kernels_move():
    """The optimizer step's modelled cost per element is what its kernel moves (optim/traffic.py:
    each tensor read and written once in its own dtype, the 16-bit weight written apart from its
    main): 28 B in fp32, 20 with both moments in bf16, 24 with one, 26 with a bf16 gradient;
    30 with a bf16 weight to write, 26 with fp16 mains, 24 when fp16 weights are their own mains."""
    gpu = GPU_PRESETS["A100-80GB"]
    times = {
        name: make_plan(cfg(**flags), 1, gpu).step_breakdown_s["optimizer"]
        for name, flags in (
            ("fp32", {}),
            ("one", dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16")),
            ("two", LEAN),
            ("grads16", GRADS16),
            ("bf16", dict(bf16=True)),
            ("bf16-mains16", dict(bf16=True, **MAINS16)),
            ("fp16-mains16", dict(fp16=True, **MAINS16)),
        )
    }
    assert times["two"] / times["fp32"] == pytest.approx(20 / 28)
    assert times["one"] / times["fp32"] == pytest.approx(24 / 28)
    assert times["grads16"] / times["fp32"] == pytest.approx(26 / 28)
    assert times["bf16-mains16"] / times["bf16"] == pytest.approx(26 / 30)
    assert times["fp16-mains16"] / times["bf16"] == pytest.approx(24 / 30)  # no 16-bit weight written apart


def _adamw_steps(chunk, dtypes, monkeypatch, steps=3):
    monkeypatch.setattr(precision_aware, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 9, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    opt = PrecisionAwareAdamW([{"params": params, "weight_decay": 0.1}], dtypes, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, [opt.state[p] for p in params]


def test_chunked_steps_are_the_whole_tensor_step(monkeypatch):
    """Chunks of 7 elements (a 45-element weight in 7 chunks, the last short) step as one chunk
    does, and with fp32 moments as torch's fused AdamW: the same step count, and weights equal up
    to the kernel's vectorised-versus-scalar rounding (1 ulp; 0 observed with 16-bit moments)."""
    lean = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float16}
    fp32 = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    for dtypes in (lean, fp32):
        small, small_state = _adamw_steps(7, dtypes, monkeypatch)
        whole, whole_state = _adamw_steps(1 << 20, dtypes, monkeypatch)
        for a, b in zip(small, whole, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-7)
        for a, b in zip(small_state, whole_state, strict=True):
            assert a["step"].item() == b["step"].item() == 3.0
            assert a["exp_avg"].dtype == dtypes["exp_avg"] and a["exp_avg_sq"].dtype == dtypes["exp_avg_sq"]
    chunked, _ = _adamw_steps(7, fp32, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 9, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    ref = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        ref.step()
    for a, b in zip(chunked, params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7)
