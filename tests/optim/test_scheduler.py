"""The LR schedule's re-warm-up after a delink or growth: the pure factor, its checkpointed
state, and a bitwise resume in the middle of it."""
import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.reshard import DelinkOptions, Target, convert
from megatron_p2r.optim.scheduler import LRScheduler, check_rewarmup, learning_rate, rewarmup_factor, with_rewarmup
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from tests.checkpoint.common import metadata
from tests.helpers import run_steps, tiny_config

PSEUDO = dict(num_layers=4, p2r_phase="pseudo", share_pattern="all", train_iters=12, global_batch_size=4,
              lr_warmup_iters=1, lr_decay_style="cosine", weight_decay=0.01, clip_grad=1.0, hidden_dropout=0.1,
              device="cpu", log_interval=100)


def test_rewarmup_factor_and_state():
    r = {"start": 5, "iters": 4}
    assert [rewarmup_factor(s, r) for s in range(4, 10)] == [1.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert rewarmup_factor(7, None) == 1.0
    assert with_rewarmup({"step_count": 5, "rewarmup": None}, 4) == {"step_count": 5, "rewarmup": r}
    for bad in ({"start": 5}, {"start": -1, "iters": 2}, {"start": 1, "iters": 0}, {"start": 1.5, "iters": 2},
                {"start": True, "iters": 2}, [5, 4]):
        with pytest.raises(ValueError, match="rewarmup must be null or"):
            check_rewarmup(bad)
    with pytest.raises(ValueError, match="--lr-rewarmup-iters must be >= 1"):
        with_rewarmup({"step_count": 5}, 0)
    t = tiny_config(**PSEUDO).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRScheduler(opt, t)
    sched.load_state_dict({"step_count": 5, "rewarmup": r})
    assert sched.lr == learning_rate(5, t) * 0.25 and opt.param_groups[0]["lr"] == sched.lr
    sched.load_state_dict({"step_count": 5})  # a checkpoint written without re-warm-up
    assert sched.rewarmup is None and sched.lr == learning_rate(5, t)


def test_rewarmup_resumes_bitwise_across_a_save_in_its_middle(tmp_path):
    """Delink with --lr-rewarmup-iters 4 at step 2; train 4 steps straight, or 2 steps, save
    (in the middle of the re-warm-up), load and 2 more: the same losses and weights, bitwise,
    and the LR ramps as recorded. Dropout is on, so the resumed RNG streams count too."""
    _, pseudo = run_steps(tiny_config(**PSEUDO), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "pseudo"), pseudo)
    convert(str(tmp_path / "pseudo"), str(tmp_path / "real"), Target(), DelinkOptions(lr_rewarmup_iters=4),
            progress=False)
    assert metadata(str(tmp_path / "real" / "iter_0000002"))["scheduler"]["rewarmup"] == {"start": 2, "iters": 4}
    cfg = tiny_config(**{**PSEUDO, "p2r_phase": "real"})
    lrs = []
    seed_everything(cfg.train.seed, 0, 0, torch.device("cpu"))  # the converted checkpoint has no RNG: a fresh run's
    straight, full = run_steps(cfg, ParallelState.single(), 4, load=str(tmp_path / "real"),
                               after_step=lambda s: lrs.append(s.optimizer.param_groups[0]["lr"]))
    assert lrs == [learning_rate(s, cfg.train) * f for s, f in zip(range(3, 7), (0.5, 0.75, 1.0, 1.0))]
    seed_everything(cfg.train.seed, 0, 0, torch.device("cpu"))
    first, half = run_steps(cfg, ParallelState.single(), 2, load=str(tmp_path / "real"))
    save_checkpoint(str(tmp_path / "half"), half)
    assert metadata(str(tmp_path / "half" / "iter_0000004"))["scheduler"]["rewarmup"] == {"start": 2, "iters": 4}
    second, resumed = run_steps(cfg, ParallelState.single(), 2, load=str(tmp_path / "half"))
    assert first + second == straight
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.scheduler.state_dict() == full.scheduler.state_dict()
