"""Megatron-LM's logging flags: the parameters' norm and the gradient's zeros over all ranks equal
the one-process model's; TensorBoard points, log records and timers at the right iterations."""

import json
import math

import pytest
import torch

from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import setup_parallel
from megatron_p2r.training.diagnostics import num_zeros_in_grad, params_norm
from megatron_p2r.training.timers import Timers, format_timers, timer_scalars
from tests.harness import run_distributed
from tests.helpers import reference_config, run_steps, tiny_config

# Unseen tokens' embedding rows have zero gradients; the key bias's is zero only up to rounding
# (softmax ignores it), which is exact or not by the order of the sums: no biases.
UNTIED = dict(untie_embeddings_and_output_weights=True, disable_bias_linear=True)
LAYOUTS = {
    "dp2": dict(UNTIED),  # every tensor on both ranks, the zeros too
    "tp2": dict(tensor_model_parallel_size=2, **UNTIED),
    "pp2_tied": dict(pipeline_model_parallel_size=2),  # the tied embedding on both stages: no zeros
    "pp2_pseudo": dict(  # each slot on both stages, and on one stage's two layers
        pipeline_model_parallel_size=2, num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2", **UNTIED
    ),
}


def _model_norm_and_zeros(model) -> tuple:
    """The one-process model's own figures: each distinct parameter once."""
    params = list(model.parameters())
    norm = math.sqrt(sum(p.detach().double().pow(2).sum().item() for p in params))
    return norm, sum(int((p.main_grad == 0).sum()) for p in params)


def _norms(rank, world, overrides):
    cfg = tiny_config(global_batch_size=4, log_num_zeros_in_grad=True, **overrides)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    outs, ref_outs = [], []
    _, state = run_steps(cfg, ps, 1, outputs=outs)
    _, ref = run_steps(reference_config(cfg), ParallelState.single(), 1, outputs=ref_outs)
    return {
        "norm": params_norm(state.optimizer, ps),
        "zeros": outs[0]["num_zeros_in_grad"],
        "recount": num_zeros_in_grad(state.optimizer, ps),
        "ref": _model_norm_and_zeros(ref.model),
        "ref_step": ref_outs[0]["num_zeros_in_grad"],
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_params_norm_and_zeros_equal_the_one_process_model(layout):
    """After a step: the norm over 2 ranks equals the one-process model's (rel 1e-6; fp32 sums in
    another order), the zeros (untied: the unseen tokens' embedding rows) exactly; a replicated
    (DP, TP), tied (PP) or shared (pseudo slot) tensor counted twice would raise them."""
    for r in run_distributed(_norms, 2, LAYOUTS[layout]):
        ref_norm, ref_zeros = r["ref"]
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-6)
        assert r["zeros"] == r["recount"] == r["ref_step"] == ref_zeros
        assert (ref_zeros > 0) == ("untie_embeddings_and_output_weights" in LAYOUTS[layout])


def _event_steps(tb_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_interval_flags_write_at_their_iterations(tmp_path, capsys):
    """--tensorboard-log-interval 2 and --log-interval 3 over 6 steps: TensorBoard's Megatron tags at
    2, 4, 6; the records (JSONL) at 3, 6 with this step's params norm and zeros, the timers of
    --timing-log-level 2 and the validation perplexity."""
    from megatron_p2r.training import pretrain

    log, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    cfg = tiny_config(
        train_iters=6,
        global_batch_size=2,
        log_interval=3,
        eval_interval=3,
        eval_iters=1,
        log_file=str(log),
        tensorboard_dir=str(tb),
        tensorboard_log_interval=2,
        log_params_norm=True,
        log_num_zeros_in_grad=True,
        log_memory_to_tensorboard=True,
        log_timers_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True,
        timing_log_level=2,
        **UNTIED,
    )
    pretrain(cfg)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["iteration"] for r in train] == [3, 6]
    for r in train:
        assert r["params_norm"] > 0 and r["num_zeros_in_grad"] > 0
        assert r["iteration-time"] > 0 and r["forward-backward-time"] > 0 and "batch-generator-time" in r
    assert [r["iteration"] for r in evals] == [3, 6]
    assert evals[0]["eval_ppl"] == pytest.approx(math.exp(evals[0]["eval_loss"]))
    points = _event_steps(tb)
    for tag in ("lm loss", "learning-rate", "grad-norm", "params-norm", "num-zeros", "mem-max-rss-bytes"):
        assert sorted(points[tag]) == [2, 4, 6], tag
    assert sorted(points["params-norm vs samples"]) == [4, 8, 12]  # 2 samples a step
    assert points["params-norm"][6] == pytest.approx(train[1]["params_norm"])
    assert points["num-zeros"][6] == train[1]["num_zeros_in_grad"]
    assert sorted(points["lm loss validation ppl"]) == [3, 6]
    out = capsys.readouterr().out
    assert out.count("(min, max) time across ranks (ms):") == 2 and "params norm" in out and "num zeros" in out


def test_timers_record_their_level_only():
    timers = Timers(1, torch.device("cpu"))
    with timers("forward-backward"):
        pass
    with timers("batch-generator"):  # level 2: not recorded at 1
        pass
    report = timers.report(steps=2)
    assert list(report) == timers.names() and "batch-generator" not in report
    assert report["forward-backward"][0] == report["forward-backward"][1] >= 0
    assert timers.report(steps=1)["forward-backward"] == (0.0, 0.0)  # reset by the report
    assert Timers(0, torch.device("cpu")).report(steps=1) == {}
    assert "forward-backward" in format_timers(report)
    assert set(timer_scalars(report, 0.5)) == {"iteration-time", *(f"{n}-time" for n in report)}


def _pretrain_pp2(rank, world, log_file, tb_dir):
    from megatron_p2r.training import pretrain

    cfg = tiny_config(
        pipeline_model_parallel_size=2,
        train_iters=2,
        global_batch_size=4,
        log_interval=2,
        log_file=log_file,
        tensorboard_dir=tb_dir,
        log_params_norm=True,
        log_num_zeros_in_grad=True,
        log_timers_to_tensorboard=True,
        timing_log_level=1,
    )
    return pretrain(cfg)["losses"]


def test_every_rank_joins_the_collectives_under_pp2(tmp_path):
    """The norm, the zeros and the timers' report are collectives of every rank: under PP 2 the
    run finishes and the last stage logs the record with them."""
    log = tmp_path / "m.jsonl"
    run_distributed(_pretrain_pp2, 2, str(log), str(tmp_path / "tb"))
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["iteration"] == 2 and record["params_norm"] > 0 and record["optimizer-time"] > 0
