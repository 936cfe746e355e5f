"""export-megatron with the optimizer state: ours -> Megatron's torch_dist -> ours (import-megatron)
gives back the weights, Adam's moments and step, the iteration, the consumed samples and the LR
schedule's position bit for bit, through the weights' own reorderings (tied vocabulary, fused
grouped-query QKV, gated fc1 rows, sinks) and under --bf16 (the fp32 mains beside bf16 weights);
the common state is what megatron-core's non-distributed optimizer and scheduler load. Megatron
loading it and taking its next step: test_export_megatron_core.py."""

import argparse
import os

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.tensor_table import tensor_table
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.megatron.exporter import export_megatron
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, TorchArchive
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.parallel.state import ParallelState
from tests.convert.megatron.test_export import MODELS
from tests.helpers import run_steps, tiny_config

# 3 steps into a 5-step warm-up of a cosine schedule, with weight decay and AdamW's beta2 0.95
SCHEDULE = dict(lr_warmup_iters=5, lr_decay_style="cosine", weight_decay=0.1)
DENSE_GPT_OSS = {k: v for k, v in MODELS["gptoss"].items() if not k.startswith("moe_") and k != "num_experts"}


def trained(path: str, options: dict, steps: int = 3) -> str:
    """Our checkpoint after ``steps`` AdamW steps (one process)."""
    _, state = run_steps(tiny_config(**SCHEDULE, **options), ParallelState.single(), steps)
    save_checkpoint(path, state)
    return path


def _same_state(a: str, b: str) -> None:
    ours, back = SourceCheckpoint(a), SourceCheckpoint(b)
    for field in ("iteration", "consumed_samples"):
        assert back.meta[field] == ours.meta[field] > 0, field
    assert back.meta["scheduler"]["num_steps"] == ours.meta["scheduler"]["num_steps"] > 0
    for key in tensor_table(ours.real_cfg):
        for kind in ("model", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(back.read(key, kind), ours.read(key, kind)), (key, kind)


@pytest.mark.parametrize(
    "model, dtype, tp, ep",
    [
        ("gpt", "float32", 1, 1),
        ("llama", "bfloat16", 1, 1),
        ("gpt_oss_dense", "float32", 2, 1),
        ("gptoss", "float32", 1, 2),
        ("gptoss_biases", "float32", 1, 2),  # biases everywhere, the router's included
    ],
)
def test_optimizer_state_round_trip_is_bitwise(tmp_path, model, dtype, tp, ep):
    options = {
        "gpt_oss_dense": DENSE_GPT_OSS,
        "gptoss_biases": dict(MODELS["gptoss"], disable_bias_linear=False),
    }.get(model) or MODELS[model]
    src = trained(str(tmp_path / "ours"), dict(options, bf16=dtype == "bfloat16"))
    if tp > 1:
        src = os.path.dirname(convert(src, str(tmp_path / "tp2"), Target(tp), progress=False))
    _, notes = export_megatron(src, str(tmp_path / "m"), dtype=dtype, ep=ep, progress=False)
    assert any(n.startswith("optimizer: Adam's moments") for n in notes), notes
    import_megatron(str(tmp_path / "m"), str(tmp_path / "back"), Target(tp, 1, None, ep), progress=False)
    _same_state(src, str(tmp_path / "back"))


def test_common_state_is_megatrons(tmp_path):
    """common.pt holds what the loading optimizer and scheduler read (plain data for Megatron's
    weights_only load): the common step, Megatron's two parameter groups in its order with our
    betas and eps, the scheduler in samples, and args that ask Megatron to load the optimizer."""
    src = trained(str(tmp_path / "ours"), {})
    out, _ = export_megatron(src, str(tmp_path / "m"), progress=False)
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(os.path.join(out, "common.pt"), weights_only=True)
    optimizer, scheduler = common["optimizer"], common["opt_param_scheduler"]
    assert optimizer["state"]["common_step"].item() == 3.0
    assert [g["wd_mult"] for g in optimizer["param_groups"]] == [1.0, 0.0]
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 and "params" not in g for g in optimizer["param_groups"])
    # micro-batch 2 on one rank: warm-up 5 x 2 samples, decay and weight-decay length 10 iterations x 2
    assert scheduler == {
        "max_lr": 1e-2,
        "lr_warmup_steps": 10,
        "num_steps": 6,
        "lr_decay_style": "cosine",
        "lr_decay_steps": 20,
        "min_lr": 0.0,
        "start_wd": 0.1,
        "end_wd": 0.1,
        "wd_incr_style": "constant",
        "wd_incr_steps": 20,
    }
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(1e-2 * 6 / 10)
    args = common["args"]
    assert (args.no_save_optim, args.no_save_rng, args.iteration, args.consumed_train_samples) == (False, True, 3, 6)


@pytest.mark.parametrize("biases, expert_groups", [(False, [1.0]), (True, [1.0, 0.0])])
def test_experts_have_their_own_chained_optimizer(tmp_path, biases, expert_groups):
    """Under EP > 1 megatron-core chains a second optimizer for the experts: common.pt's optimizer
    is {0: dense, 1: experts}, the experts' no-weight-decay group only with expert biases; under
    EP 1 the experts are dense parameters, in one optimizer."""
    src = trained(
        str(tmp_path / "ours"),
        dict(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=False, disable_bias_linear=not biases),
        steps=1,
    )
    out, _ = export_megatron(src, str(tmp_path / "ep1"), progress=False)
    single = TorchArchive(os.path.join(out, "common.pt"), Kind.MEGATRON).obj["optimizer"]
    assert [g["wd_mult"] for g in single["param_groups"]] == [1.0, 0.0]
    out, _ = export_megatron(src, str(tmp_path / "m"), ep=2, progress=False)
    optimizer = TorchArchive(os.path.join(out, "common.pt"), Kind.MEGATRON).obj["optimizer"]
    assert sorted(optimizer) == [0, 1]
    assert [(g["is_expert_parallel"], g["wd_mult"]) for g in optimizer[0]["param_groups"]] == [
        (False, 1.0),
        (False, 0.0),
    ]
    assert [(g["is_expert_parallel"], g["wd_mult"]) for g in optimizer[1]["param_groups"]] == [
        (True, wd) for wd in expert_groups
    ]
    assert optimizer[0]["state"]["common_step"].read().item() == optimizer[1]["state"]["common_step"].read().item() == 1


@pytest.mark.parametrize(
    "options, argv, why",
    [
        ({}, ["--no-save-optim"], "--no-save-optim"),
        ({}, ["--ckpt-format", "torch"], "the optimizer state is written in torch_dist only"),
        ({}, ["--dtype", "float16"], "loss scaler"),
        (dict(optimizer="lion"), [], "--optimizer lion's state has no Megatron-LM counterpart"),
        (dict(qk_layernorm=True, apply_wd_to_qk_layernorm=True), [], "--apply-wd-to-qk-layernorm moves the query/key"),
    ],
)
def test_weights_only_says_why(tmp_path, capsys, options, argv, why):
    from tools.convert_checkpoint import main

    src = trained(str(tmp_path / "ours"), options, steps=1)
    assert main(["export-megatron", src, str(tmp_path / "m"), "--no-progress", *argv]) == 0
    out = capsys.readouterr().out
    assert "weights only (" in out and why in out, out
    iter_dir = tmp_path / "m" / "iter_0000001"
    header = (
        iter_dir / "common.pt" if (iter_dir / "common.pt").exists() else iter_dir / "mp_rank_00" / "model_optim_rng.pt"
    )
    saved = TorchArchive(str(header), Kind.MEGATRON).obj
    assert saved["args"].no_save_optim and "optimizer" not in saved


@pytest.mark.parametrize(
    "values",
    [
        dict(train_iters=10, global_batch_size=4, lr_warmup_iters=2, lr_decay_iters=8),
        dict(train_iters=10, global_batch_size=4, lr_warmup_fraction=0.25),
        dict(train_samples=64, global_batch_size=4, lr_warmup_samples=8, lr_decay_samples=48, lr_decay_style="cosine"),
        dict(train_samples=64, global_batch_size=4, lr_warmup_samples=8, weight_decay=0.05, min_lr=1e-4),
    ],
)
def test_the_notes_schedule_flags_give_the_saved_schedule(values):
    """The flags the export's note says to pass, given to Megatron's parser (ours has its
    meanings), make the same OptimizerParamScheduler state as the one exported: what Megatron
    compares on resume, the weight-decay length included."""
    from megatron_p2r.arguments import parse_args
    from megatron_p2r.convert.megatron.export_optim import scheduler_flags, scheduler_state

    cfg = tiny_config(**values)
    flags = scheduler_flags(cfg, 1)
    again = parse_args(["--mock-data", "--vocab-size", "64", "--micro-batch-size", "2"] + flags)
    assert scheduler_state(again, 0, 1) == scheduler_state(cfg, 0, 1)
    assert "--weight-decay-incr-style" in flags and ("--train-samples" in flags) == ("train_samples" in values)


def test_the_note_names_the_schedule_and_the_override(tmp_path):
    src = trained(str(tmp_path / "ours"), {})
    _, notes = export_megatron(src, str(tmp_path / "m"), progress=False)
    schedule = [n for n in notes if n.startswith("Megatron-LM checks the saved LR")]
    assert schedule and "--train-iters 10 --global-batch-size 2" in schedule[0], notes
    assert "weight-decay length 20 samples" in schedule[0] and "--override-opt-param-scheduler" in schedule[0]
