"""Checkpoints on CUDA beyond bitwise resume (tests/cuda/test_resume.py): ``--async-save``'s
device-to-host copy (training goes on while a thread writes the copy), loading it back onto the
device with the CUDA RNG state, and the start-up memory preflight reading the device's free
memory (``torch.cuda.mem_get_info``)."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_p2r.checkpoint import async_save  # noqa: E402
from megatron_p2r.checkpoint.io import load_checkpoint  # noqa: E402
from megatron_p2r.config import ConfigError, num_microbatches  # noqa: E402
from megatron_p2r.layout.plan import ParallelPlan  # noqa: E402
from megatron_p2r.lifecycle import check_run_fits  # noqa: E402
from megatron_p2r.planning.preflight import SKIP_ENV  # noqa: E402
from megatron_p2r.training import build_datasets, build_train_state, microbatch_iterator, train_step  # noqa: E402
from megatron_p2r.parallel.random import seed_everything  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from tests.cuda.compare import relative  # noqa: E402
from tests.cuda.test_numerics import SHAPE  # noqa: E402
from tests.helpers import run_steps  # noqa: E402

pytestmark = pytest.mark.cuda

SAVE = dict(SHAPE, bf16=True, lr_warmup_iters=1, lr_decay_style="cosine", train_iters=4, hidden_dropout=0.1)
# CUDA and CPU draw different dropout masks at the same rate: their losses agree only this far
DROPOUT_LOSS = 5e-2


def next_step(state) -> float:
    """One more training step of ``state`` on its next micro-batches."""
    cfg, ps = state.cfg, state.ps
    train_ds, _ = build_datasets(cfg, ps)
    data = microbatch_iterator(train_ds, state.consumed_samples, cfg, ps)
    return train_step(state, [next(data) for _ in range(num_microbatches(cfg, ps.layout.world_size))])["lm_loss"]


def save_step_reload(cfg, ps, directory: str, monkeypatch):
    """Train 2 steps, start an asynchronous save, train a 3rd step before its writer may write
    (held until then: the worst order for the host copy), publish it, load it into a new state:
    (the weights when the save started, the 3rd loss, the loaded state's weights, the 3rd loss
    of the loaded state)."""
    _, state = run_steps(cfg, ps, 2)
    trained, write = threading.Event(), async_save.write_parts
    monkeypatch.setattr(async_save, "write_parts", lambda *args: (trained.wait(120), write(*args)))
    async_save.save_checkpoint(directory, state)  # returns once the host copy is taken
    saved = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    third = next_step(state)  # updates the weights in place meanwhile
    trained.set()
    async_save.finish_pending(ps)
    loaded = build_train_state(cfg, ps)
    load_checkpoint(directory, loaded)
    weights = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    return saved, third, weights, next_step(loaded)


def test_async_save_copies_to_host_before_training_goes_on(lane, record_property, tmp_path, monkeypatch):
    """The checkpoint holds the weights of the moment the save started, bitwise, although the
    next step rewrote them on the device before the writer wrote; loaded back onto the device (RNG
    states included, dropout on) it trains the 3rd step bitwise as the uninterrupted run did,
    and that loss follows the same run on CPU (other dropout masks: ``DROPOUT_LOSS``)."""
    cfg = lane.config({**SAVE, "async_save": True})
    saved, third, loaded, resumed_third = save_step_reload(
        cfg, lane.parallel(cfg), str(tmp_path / "device"), monkeypatch
    )
    differ = [n for n, w in saved.items() if not torch.equal(w.cpu(), loaded[n].cpu())]
    record_property("third_loss", {"uninterrupted": third, "resumed": resumed_third})
    assert not differ, f"weights in the checkpoint differ from those at save time: {differ}"
    assert resumed_third == third
    cpu_cfg = cfg.replace(device="cpu")
    seed_everything(cpu_cfg.train.seed, 0, 0, torch.device("cpu"))
    _, cpu_third, _, _ = save_step_reload(cpu_cfg, ParallelState.single(), str(tmp_path / "cpu"), monkeypatch)
    record_property("third_loss_rel_err_vs_cpu", relative([third], [cpu_third]))
    assert relative([third], [cpu_third])[0] < DROPOUT_LOSS, (third, cpu_third)


def test_preflight_reads_free_device_memory(lane, record_property, monkeypatch):
    """``lifecycle.check_run_fits`` on CUDA compares the planner's device bytes with
    ``torch.cuda.mem_get_info``'s free bytes: a tiny run passes, a 100B-parameter one is refused
    with one ``ConfigError`` naming the device (on CPU the same run is refused for host memory)."""
    monkeypatch.delenv(SKIP_ENV, raising=False)
    small = lane.config(SHAPE)
    check_run_fits(small, ParallelPlan.for_world(small, 1), lane.device)
    huge = lane.config({**SHAPE, "num_layers": 96, "hidden_size": 9216, "num_attention_heads": 72})
    with pytest.raises(ConfigError) as refused:
        check_run_fits(huge, ParallelPlan.for_world(huge, 1), lane.device)
    record_property("refusal", str(refused.value))
    if lane.cuda:
        record_property("mem_get_info", torch.cuda.mem_get_info(lane.device))
    assert ("does not fit on the device" if lane.cuda else "of host memory") in str(refused.value), refused.value
