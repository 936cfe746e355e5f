"""The training loop: DP=2 and TP=2 x DP=2 reproduce one process; fp16 loss scaling; logging."""
import json

import pytest
import torch

from megatron_p2r.moe import aux_loss
from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.testing import run_distributed
from megatron_p2r.training import ExitSignal, build_train_state, setup_parallel, train_step
from tests.helpers import random_microbatches, reference_config, run_steps, tiny_config


def _data_parallel(rank, world, tp):
    cfg = tiny_config(tensor_model_parallel_size=tp, global_batch_size=8, num_experts=None)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    losses, state = run_steps(cfg, ps, 3)
    ref_losses, ref_state = run_steps(reference_config(cfg), ParallelState.single(), 3)
    ref_params = dict(ref_state.model.named_parameters())
    from tests.helpers import expected_shard
    weight_err = max((p.detach() - expected_shard(ref_params[n].detach(), p, ps)).abs().max().item()
                     for n, p in state.model.named_parameters())
    return losses, ref_losses, weight_err


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_data_parallel_reproduces_single_process(world, tp):
    """Same global batch, split over DP ranks: same losses (fp32, rel 1e-5) and weights
    (abs 1e-4, against updates of up to 3e-2 at lr 1e-2) after 3 steps."""
    for losses, ref_losses, weight_err in run_distributed(_data_parallel, world, tp):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert weight_err < 1e-4  # Adam divides by sqrt(v): tiny-gradient elements amplify rounding


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
    cfg = tiny_config(fp16=True, initial_loss_scale=1024.0, num_experts=4, moe_ffn_hidden_size=24,
                      moe_aux_loss_coeff=0.01)
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
    cfg = tiny_config(train_iters=4, log_interval=2, log_file=str(log), eval_interval=4, eval_iters=1,
                      tensorboard_dir=str(tmp_path / "tb"), global_batch_size=4)
    result = pretrain(cfg)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train_records = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train_records] == [2, 4]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_s", "tflops"):
        assert key in train_records[0]
    losses = result["losses"]  # a record averages the losses of its log interval, as Megatron's line does
    assert [r["lm_loss"] for r in train_records] == pytest.approx([(losses[0] + losses[1]) / 2,
                                                                   (losses[2] + losses[3]) / 2])
    assert any("eval_loss" in r for r in records)
    assert list((tmp_path / "tb").iterdir())  # TensorBoard event file written
