"""The training loop: DP=2 and TP=2 x DP=2 reproduce one process; fp16 loss scaling; logging."""

import json

import pytest
import torch

from megatron_p2r.moe import aux_loss
from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.parallel.state import Layout, ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import ExitSignal, build_train_state, setup_parallel, train_step
from tests.helpers import (
    expected_shard,
    keep_first_step_grads,
    random_microbatches,
    reference_config,
    run_steps,
    tiny_config,
)

CLIP = 0.5  # --clip-grad below every step's gradient norm


def _data_parallel(rank, world, tp):
    cfg = tiny_config(tensor_model_parallel_size=tp, global_batch_size=8, num_experts=None, clip_grad=CLIP)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    grads, ref_grads, outs, ref_outs = {}, {}, [], []
    losses, state = run_steps(cfg, ps, 3, after_step=keep_first_step_grads(grads), outputs=outs)
    ref_losses, ref_state = run_steps(
        reference_config(cfg), ParallelState.single(), 3, after_step=keep_first_step_grads(ref_grads), outputs=ref_outs
    )
    ref_params = dict(ref_state.model.named_parameters())
    weight_err = max(
        (p.detach() - expected_shard(ref_params[n].detach(), p, ps)).abs().max().item()
        for n, p in state.model.named_parameters()
    )
    grad_err = max(
        (grads[n] - expected_shard(ref_grads[n], p, ps)).abs().max().item() for n, p in state.model.named_parameters()
    )
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight_err": weight_err,
        "grad_err": grad_err,
        "norms": [o["grad_norm"] for o in outs],
        "ref_norms": [o["grad_norm"] for o in ref_outs],
    }


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_data_parallel_reproduces_single_process(world, tp):
    """Same global batch, split over DP ranks: same losses (fp32, rel 1e-5) and weights
    (abs 1e-4, against updates of up to 3e-2 at lr 1e-2) after 3 steps. AdamW is blind to a
    gradient's scale, so the scale is checked where it shows: each step's gradient norm (rel
    1e-5; observed 1.0, 0.85, 0.65 on one process, all clipped to CLIP) and the first step's
    clipped gradients (abs 1e-6; a DP sum instead of the mean doubles the norms)."""
    for r in run_distributed(_data_parallel, world, tp):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert min(r["ref_norms"]) > CLIP  # every step clips: the clipping path is exercised
        assert r["grad_err"] < 1e-6, r["grad_err"]
        assert r["weight_err"] < 1e-4  # Adam divides by sqrt(v): tiny-gradient elements amplify rounding


def test_fp16_scaler_skips_non_finite_step_and_lowers_scale():
    cfg = tiny_config(fp16=True, initial_loss_scale=1024.0)
    state = build_train_state(cfg, ParallelState.single())
    before = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    mbs = random_microbatches(cfg, 1, 2)
    state.model.embedding.word_embeddings.weight.register_hook(lambda g: g * float("inf"))
    out = train_step(state, mbs)
    assert out["skipped"] and state.scaler.scale == 512.0 and state.skipped_in_a_row == 1
    assert all(torch.equal(before[n], p) for n, p in state.model.named_parameters())  # no update


def test_train_step_gives_moe_router_losses_the_schedules_backward_scale(monkeypatch):
    """The schedules know nothing of MoE; train_step hands them moe.aux_loss's setter, which
    must receive loss scale / micro-batches (router losses averaged over micro-batches)."""
    calls = []
    monkeypatch.setattr(aux_loss, "set_backward_scale", calls.append)
    cfg = tiny_config(
        fp16=True, initial_loss_scale=1024.0, num_experts=4, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01
    )
    train_step(build_train_state(cfg, ParallelState.single()), random_microbatches(cfg, 4, 2))
    assert calls == [1024.0 / 4]


def test_exit_signal_check_is_no_collective_without_the_handler():
    """Without --exit-signal-handler nothing can set the flag, so the per-step check must not
    all-reduce over the world (a collective and a host sync every step): here no process
    group exists, and a collective would raise."""
    assert not ExitSignal(False).any_rank(ParallelState(layout=Layout(dp=2), rank=0))


def test_loss_scaler_grows_after_window():
    scaler = LossScaler(tiny_config(fp16=True, initial_loss_scale=8.0, loss_scale_window=2).train)
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 8.0
    assert LossScaler(tiny_config().train).scale == 1.0  # bf16/fp32: constant


def test_single_process_pretrain_logs_jsonl(tmp_path):
    from megatron_p2r.training import pretrain

    log = tmp_path / "m.jsonl"
    cfg = tiny_config(
        train_iters=4,
        log_interval=2,
        log_file=str(log),
        eval_interval=4,
        eval_iters=1,
        tensorboard_dir=str(tmp_path / "tb"),
        global_batch_size=4,
    )
    result = pretrain(cfg)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train_records = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train_records] == [2, 4]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_s", "tflops"):
        assert key in train_records[0]
    losses = result["losses"]  # a record averages the losses of its log interval, as Megatron's line does
    assert [r["lm_loss"] for r in train_records] == pytest.approx(
        [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2]
    )
    assert any("eval_loss" in r for r in records)
    assert list((tmp_path / "tb").iterdir())  # TensorBoard event file written


@pytest.mark.parametrize("data", ["mock", "indexed"])
def test_eval_iters_0_trains_without_validation(tmp_path, data):
    """Megatron-LM's --eval-iters 0: no validation set is built and --eval-interval evaluates nothing."""
    from megatron_p2r.training import build_datasets, pretrain

    cfg = tiny_config(train_iters=2, eval_interval=1, eval_iters=0, global_batch_size=2)
    if data == "indexed":
        from tests.data.test_gpt_dataset import make_dataset

        make_dataset(tmp_path / "corpus", [40] * 20)
        cfg = cfg.replace(mock_data=False, data_path=[str(tmp_path / "corpus")], split="90,10,0", vocab_size=1000)
    assert build_datasets(cfg, ParallelState.single())[1] is None
    result = pretrain(cfg)
    assert len(result["losses"]) == 2 and result["eval_losses"] == []


def test_eval_only_with_eval_iters_0_is_refused():
    from megatron_p2r.config import ConfigError
    from megatron_p2r.config.validation import validate

    with pytest.raises(ConfigError, match="--eval-only evaluates --eval-iters batches: 0 evaluates nothing"):
        validate(tiny_config(eval_only=True, eval_iters=0), 1)
