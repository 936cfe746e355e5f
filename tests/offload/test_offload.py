"""Granular CPU offload (megatron_p2r/offload, layout/offload.py): the flags, which layers are
chosen, where the tensors live, and that training with any offload spec is the training without it.

Numerics: every case trains the same config with and without offload on the same layout and
compares losses, weights, each step's gradient norm and the first step's gradients (clipped:
every step's norm is above CLIP). AdamW is blind to a gradient's scale, so a gradient added
twice in an offloaded layer shows in the norms and in the clipped gradients' direction, not in
the losses or weights. On CPU the offloaded path runs exactly the same fp32 kernels on copies of
the weights (recomputation replays the forward bit for bit), so the tolerance is tight: 1e-6
relative on losses and norms, 1e-6 absolute on weights (updates are ~1e-2 at lr 1e-2) and
gradients.
"""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.config import OPTIMIZER_ONLY, ConfigError, LayerSpec, parse_memory_size, validate
from megatron_p2r.layout import offload as off
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import build_train_state, setup_parallel
from tests.helpers import keep_first_step_grads, random_microbatches, run_steps, tiny_config

LOSS_REL, WEIGHT_ABS = 1e-6, 1e-6
CLIP = 0.5  # below every step's gradient norm (one process: 1.7, 1.2, 1.0)
BASE = dict(num_layers=4, global_batch_size=4, clip_grad=CLIP)  # 2 micro-batches of 2 per step (one rank)


def _cfg(**kw):
    return tiny_config(**{**BASE, **kw})


def compare(
    kw: dict, spec: str, ps: ParallelState, steps: int = 2, prefetch: int = 1, what: str = "params,grads,optimizer"
) -> dict:
    """Train ``steps`` steps without and with ``--cpu-offload-layers spec``: loss and weight
    errors, the offload instrumentation, and whether the host optimizer owns exactly the
    offloaded parameters."""
    seed = _cfg(**kw).train.seed
    grads, ref_grads, outs, ref_outs = {}, {}, [], []
    seed_everything(seed, ps.tp_rank, ps.pp_rank, ps.device)  # both runs start from the same dropout streams
    ref_losses, ref = run_steps(_cfg(**kw), ps, steps, after_step=keep_first_step_grads(ref_grads), outputs=ref_outs)
    seed_everything(seed, ps.tp_rank, ps.pp_rank, ps.device)
    losses, state = run_steps(
        _cfg(**kw, cpu_offload_layers=spec, offload_prefetch=prefetch, cpu_offload_what=what),
        ps,
        steps,
        after_step=keep_first_step_grads(grads),
        outputs=outs,
    )
    ref_params = dict(ref.model.named_parameters())
    weight_err = max(
        (p.detach() - ref_params[n].detach()).abs().max().item() for n, p in state.model.named_parameters()
    )
    grad_err = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    man = state.offload
    host_ids = {id(ms.param) for ms in state.optimizer.shards if ms.placement != "device"}
    on_device = all(p.device == ps.device for p in state.model.parameters())  # trivially true on CPU
    moments_apart = all(
        state.optimizer.state[p]["exp_avg"].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
        for p in state.model.parameters()
    )
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight_err": weight_err,
        "grad_err": grad_err,
        "norms": [o["grad_norm"] for o in outs],
        "ref_norms": [o["grad_norm"] for o in ref_outs],
        "keys": man.keys,
        "weights_fetched": any(getattr(c, "func", None) == man.run_layer for c in man.model.layer_calls),
        "on_device": on_device,
        "moments_apart": moments_apart,
        "peak": dict(man.stats["peak_live"]),
        "fetches": dict(man.stats["fetches"]),
        "live_after": man.stats["live"],
        "host_opt_exact": host_ids == man.offloaded_param_ids,
        "names_same": sorted(n for n, _ in state.model.named_parameters()) == sorted(ref_params),
    }


def check(r: dict, keys=None) -> None:
    assert r["names_same"]
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=LOSS_REL)
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=LOSS_REL) and min(r["ref_norms"]) > CLIP
    assert r["grad_err"] <= WEIGHT_ABS
    assert r["weight_err"] <= WEIGHT_ABS
    assert r["host_opt_exact"] and r["live_after"] == 0 and r["moments_apart"]
    if r["weights_fetched"]:
        assert r["fetches"]["forward"] > 0 and r["fetches"]["forward"] == r["fetches"]["backward"]
    else:  # optimizer state only: layers run as usual
        assert r["fetches"] == {"forward": 0, "backward": 0} and r["on_device"]
    if keys is not None:
        assert r["keys"] == keys


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "spec,keys",
    [("1", [3]), ("0.5", [2, 3]), ("1.0", [0, 1, 2, 3]), ("0,2", [0, 2]), ("3,", [3]), ("4", [0, 1, 2, 3]), ("0", [])],
)
def test_dense_specs_match_resident_training(spec, keys):
    check(compare({}, spec, ParallelState.single()), keys)


@pytest.mark.parametrize(
    "kw,spec,keys",
    [
        (
            dict(bf16=True, hidden_dropout=0.1, attention_dropout=0.1),
            "0.5",
            [2, 3],
        ),  # 16-bit weights + replayed dropout
        (dict(p2r_phase="pseudo", share_pattern="cycle:2"), "1", [1]),  # slot 1 serves layers 1 and 3
        (dict(p2r_phase="pseudo", share_pattern="all"), "2", [0]),  # one slot, offloaded once
        (dict(num_experts=4, moe_layer_freq=2, moe_aux_loss_coeff=0.01), "0.5", [2, 3]),  # layer 2 is MoE
        (dict(recompute_activations=True, untie_embeddings_and_output_weights=True), "0,3", [0, 3]),
        # full recomputation in chunks of 2 layers; the offloaded layers 1 and 2 leave their chunks
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2), "1,2", [1, 2]),
    ],
)
def test_variants_match_resident_training(kw, spec, keys):
    """bf16 losses are compared with the same tolerance: both runs execute identical kernels."""
    check(compare(kw, spec, ParallelState.single()), keys)


@pytest.mark.parametrize(
    "kw,spec,keys",
    [
        ({}, "0.5", [2, 3]),
        (dict(num_experts=4, moe_layer_freq=[0, 1, 0, 1], moe_aux_loss_coeff=0.01), "1,3", [1, 3]),
        (dict(p2r_phase="pseudo", share_pattern="cycle:2"), "1", [1]),
    ],
)
def test_optimizer_only_offload_matches_resident_training(kw, spec, keys):
    """--cpu-offload-what optimizer: the layers' AdamW moments on host, stepped there."""
    r = compare(kw, spec, ParallelState.single(), what="optimizer")
    check(r, keys)
    assert not r["weights_fetched"]


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_at_most_prefetch_plus_one_layers_on_device(prefetch):
    """All 4 layers offloaded, 2 micro-batches, 2 steps: in forward and in backward
    (recomputation) exactly min(prefetch + 1, 4) fetched layers coexist at the peak."""
    r = compare({}, "4", ParallelState.single(), prefetch=prefetch)
    check(r)
    want = min(prefetch + 1, 4)
    assert r["peak"] == {"forward": want, "backward": want}
    assert r["fetches"] == {"forward": 4 * 2 * 2, "backward": 4 * 2 * 2}


def test_forward_only_releases_copies_and_matches():
    cfg = _cfg(cpu_offload_layers="0.5", offload_prefetch=1)
    state = build_train_state(cfg, ParallelState.single())
    ref = build_model(_cfg(), ParallelState.single())
    mb = random_microbatches(cfg, 1, 2)[0]
    with torch.no_grad():
        got = state.model(tokens=mb["tokens"], labels=mb["labels"])
        want = ref(tokens=mb["tokens"], labels=mb["labels"])
    assert torch.equal(got, want)
    assert state.offload.stats["peak_live"]["forward"] == 2 and state.offload.stats["live"] == 0
    assert state.offload.stats["fetches"]["backward"] == 0


class _LinearWeights(torch.overrides.TorchFunctionMode):
    """Records the storage and size of every weight a linear layer computes with."""

    def __init__(self):
        super().__init__()
        self.used = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            w = args[1] if len(args) > 1 else kwargs["weight"]
            self.used.append((w.untyped_storage().data_ptr(), w.numel()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("what", ["params,grads,optimizer", "optimizer"])
def test_offloaded_layers_compute_on_separate_copies_and_keep_host_moments(what):
    """Where tensors live, checked on CPU where "host" and "device" are one memory: an offloaded
    layer's parameters (the host masters) are never what its matmuls read — the forward reads
    separate copies of the same sizes and backward fetches again to recompute — while resident
    layers compute on their parameters in place. With only the optimizer offloaded, the layers
    compute on their parameters. Either way the host optimizer owns exactly the offloaded layers."""
    state = build_train_state(
        _cfg(cpu_offload_layers="2", offload_prefetch=0, cpu_offload_what=what), ParallelState.single()
    )
    model = state.model
    params = {
        k: {
            p.untyped_storage().data_ptr(): p.numel()
            for n, p in model.layers[str(k)].named_parameters()
            if n.endswith(".weight") and p.dim() == 2
        }
        for k in (0, 1, 2, 3)
    }
    mode = _LinearWeights()
    with mode:  # the forward (autograd's backward runs outside a thread-local mode)
        loss = model(**{k: v for k, v in random_microbatches(state.cfg, 1, 2)[0].items() if k != "loss_mask"})
    loss.mean().backward()
    all_params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    used = {ptr for ptr, _ in mode.used}
    copies = sorted(n for ptr, n in mode.used if ptr not in all_params)
    for k in (0, 1):  # resident: the parameters themselves
        assert set(params[k]) <= used, k
    offloaded_sizes = sorted(n for k in (2, 3) for n in params[k].values())
    if "params" in what:  # the forward reads its own copy of every weight, of the weight's size
        assert not set(params[2]) & used and not set(params[3]) & used
        assert copies == offloaded_sizes
        assert state.offload.stats["fetches"] == {"forward": 2, "backward": 2}  # recomputation fetched again
    else:  # only the moments live on host: the layers compute on their parameters
        assert set(params[2]) | set(params[3]) <= used and copies == []
    host = state.optimizer.inner["host" if "params" in what else "staged"]
    owned = {id(p) for g in host.param_groups for p in g["params"]}  # fp32: the parameters are the mains
    assert owned == {id(p) for k in (2, 3) for p in model.layers[str(k)].parameters()}
    assert state.offload.stats["live"] == 0  # no copy outlives the step


def test_scheduler_reaches_device_and_host_optimizers():
    _, state = run_steps(_cfg(cpu_offload_layers="0.5"), ParallelState.single(), 1)
    opt = state.optimizer
    assert sorted(opt.inner) == ["device", "host"]
    for g in opt.param_groups:
        g["lr"] = 123.0
    state.scheduler.step(4)
    assert {g["lr"] for o in opt.inner.values() for g in o.param_groups} == {state.scheduler.lr}


# ----------------------------------------------------------------------------- choosing layers


def test_auto_offloads_fewest_last_layers_that_fit():
    cfg = _cfg(cpu_offload_layers="auto", device_memory_budget="1GiB", offload_prefetch=1)
    plan = ParallelPlan.build(cfg, Layout())
    total = off.state_bytes(sum(s.numel for s in plan.tensors(0)))
    per_module = {k: off.state_bytes(n) for k, n in plan.module_numel(0).items()}
    accounted = sum(total[k] for k in off.CATEGORIES)  # the bytes ("stepped" counts elements)
    need_two = sum(off.memory_plan(total, per_module, [3, 2], 1)["device"].values())
    assert off.choose_auto(total, per_module, [3, 2, 1, 0], 1, need_two, "rank 0", "x") == [3, 2]
    assert off.choose_auto(total, per_module, [3, 2, 1, 0], 1, need_two - 1, "rank 0", "x") == [3, 2, 1]
    assert off.choose_auto(total, per_module, [3, 2, 1, 0], 1, accounted, "rank 0", "x") == []
    state = build_train_state(
        _cfg(cpu_offload_layers="auto", device_memory_budget=str(need_two)), ParallelState.single()
    )
    assert state.offload.keys == [2, 3]
    report = state.offload.describe()
    assert sum(report["device"].values()) <= need_two
    assert report["host"]["params"] == per_module[2]["params"] + per_module[3]["params"]
    assert report["host"]["optimizer"] == 2 * report["host"]["params"]  # fp32 moments
    # optimizer state only: no fetch window, only the moments move
    opt_only = OPTIMIZER_ONLY
    need_opt = sum(off.memory_plan(total, per_module, [3, 2], 1, opt_only)["device"].values())
    assert need_opt == accounted - per_module[3]["optimizer"] - per_module[2]["optimizer"]
    assert off.choose_auto(total, per_module, [3, 2, 1, 0], 1, need_opt, "rank 0", "x", opt_only) == [3, 2]


def test_auto_with_sharing_counts_a_slot_once():
    assert off.last_first([0, 1, 0, 1]) == [1, 0]
    assert off.select_modules(LayerSpec("count", count=1), [0, 1, 0, 1], range(0, 4)) == [1]
    assert off.select_modules(LayerSpec("list", layers=(5,)), [4, 5, 6], range(4, 7)) == [5]
    assert off.select_modules(LayerSpec("list", layers=(1,)), [4, 5, 6], range(4, 7)) == []
    assert off.select_modules(LayerSpec("fraction", fraction=0.25), [4, 5, 6, 7, 8, 9], range(4, 10)) == [8, 9]


def test_impossible_budget_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"--device-memory-budget 10KiB .* cannot be met on stage 0"):
        build_train_state(_cfg(cpu_offload_layers="auto", device_memory_budget="10KiB"), ParallelState.single())


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(cpu_offload_layers="x"), "expected a count N"),
        (dict(cpu_offload_layers="1.5"), "between 0 and 1"),
        (dict(cpu_offload_layers="0,9"), r"in \[0, 4\)"),
        (dict(cpu_offload_layers="1,1"), "appears twice"),
        (dict(cpu_offload_layers="7"), "between 0 and --num-layers"),
        (dict(cpu_offload_layers="auto"), "needs --device-memory-budget"),
        (dict(cpu_offload_layers="1", device_memory_budget="1GiB"), "only with --cpu-offload-layers auto"),
        (dict(device_memory_budget="1GiB"), "only with --cpu-offload-layers auto"),
        (dict(cpu_offload_layers="auto", device_memory_budget="lots"), "expected a size"),
        (dict(cpu_offload_layers="1", cpu_offload_what="params,moments"), "subset of params,grads,optimizer"),
        (dict(cpu_offload_layers="1", cpu_offload_what="params"), r"or optimizer \(AdamW state only\)"),
        (dict(cpu_offload_layers="1", cpu_offload_what="grads,optimizer"), "a gradient is produced where its weight"),
        (dict(cpu_offload_layers="1", offload_prefetch=-1), "--offload-prefetch must be >= 0"),
    ],
)
def test_flag_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**kw), 1)


def test_memory_sizes():
    assert parse_memory_size("30GiB") == 30 * 2**30
    assert parse_memory_size("1.5 MiB") == int(1.5 * 2**20)
    assert parse_memory_size("40GB") == 40 * 10**9
    assert parse_memory_size("123") == 123


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_does_not_depend_on_offload(tmp_path):
    """Saved with layers offloaded, resumed without (and the reverse): same weights, moments
    and next losses as a run that never offloaded."""
    from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint

    ps = ParallelState.single()
    _, plain = run_steps(_cfg(), ps, 2)
    _, offl = run_steps(_cfg(cpu_offload_layers="0.5"), ps, 2)
    save_checkpoint(str(tmp_path / "off"), offl)
    save_checkpoint(str(tmp_path / "plain"), plain)
    _, staged = run_steps(_cfg(cpu_offload_layers="2", cpu_offload_what="optimizer"), ps, 2)
    save_checkpoint(str(tmp_path / "staged"), staged)
    for src, target_kw in (
        ("off", {}),
        ("plain", dict(cpu_offload_layers="1,3")),
        ("staged", {}),
        ("plain", dict(cpu_offload_layers="0,", cpu_offload_what="optimizer")),
    ):
        target = build_train_state(_cfg(**target_kw), ps)
        load_checkpoint(str(tmp_path / src), target)
        want = dict(plain.model.named_parameters())
        for n, p in target.model.named_parameters():
            assert torch.equal(p.detach(), want[n].detach()), n
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(target.optimizer.state[p][kind], plain.optimizer.state[want[n]][kind]), (n, kind)


# ----------------------------------------------------------------------------- parallel layouts

FULL = "params,grads,optimizer"
CASES = [  # label, layout and model flags, offload spec, what is offloaded
    ("tp2", dict(tensor_model_parallel_size=2), "1", FULL),
    ("pp2", dict(pipeline_model_parallel_size=2, global_batch_size=8), "1", FULL),  # 4 micro-batches of 1F1B
    ("pp2-pseudo", dict(pipeline_model_parallel_size=2, p2r_phase="pseudo", share_pattern="all"), "1", FULL),
    (
        "dp2-ep2-moe",
        dict(expert_model_parallel_size=2, num_experts=4, moe_layer_freq=2, global_batch_size=8),
        "0.5",
        FULL,
    ),
    ("tp2-optimizer-only", dict(tensor_model_parallel_size=2), "0.5", "optimizer"),
]


def _parallel_cases(rank, world):
    out = {}
    for label, kw, spec, what in CASES:
        ps, _ = setup_parallel(_cfg(**kw), torch.device("cpu"))
        out[label] = compare(kw, spec, ps, what=what)
    return out


def test_parallel_layouts_match_resident_training():
    """TP=2, PP=2 (1F1B), PP=2 pseudo phase (a slot shared by both stages), DP=2 x EP=2 MoE,
    and TP=2 with only the optimizer state offloaded."""
    results = run_distributed(_parallel_cases, 2)
    for rank, res in enumerate(results):
        for label, r in res.items():
            try:
                check(r)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} case {label}: {r}") from e
            assert r["peak"]["forward"] <= 2 and r["peak"]["backward"] <= 2
    # PP=2: each stage offloads its own last layer (global layers 1 and 3)
    assert [r["pp2"]["keys"] for r in results] == [[1], [3]]
    assert [r["pp2-pseudo"]["keys"] for r in results] == [[0], [0]]


def test_pretrain_logs_device_and_host_bytes_and_trains_the_same(capsys):
    """The start-up line per rank, and pretrain (with evaluation) gives the resident run's losses."""
    from megatron_p2r.training import pretrain

    kw = dict(train_iters=2, eval_interval=2, eval_iters=1, device="cpu")
    plain = pretrain(_cfg(**kw))
    result = pretrain(_cfg(**kw, cpu_offload_layers="2", offload_prefetch=0))
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "offload:" in s)
    assert line.startswith(
        "[rank 0] offload: params,grads,optimizer of 2 of 4 layers on host (layers [2, 3], modules [2, 3], prefetch 0)"
    )
    for part in ("device: params", "grads", "optimizer", "fetch window", "host: params"):
        assert part in line
    assert result["losses"] == pytest.approx(plain["losses"], rel=LOSS_REL)
    assert result["eval_losses"] == pytest.approx(plain["eval_losses"], rel=LOSS_REL)
