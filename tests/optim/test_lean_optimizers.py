"""Lion and Adafactor (--optimizer lion|adafactor) on one process: Adafactor against torch's,
a matrix cut into two pieces (as the distributed optimizer cuts it) against the whole, the
checkpoint form of its statistics, Lion against its update rule, conversions between
optimizers' checkpoints, and the planner's bytes against what a rank allocates."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.config import ConfigError
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.optim import adafactor as af
from megatron_p2r.optim.factored_form import FACTOR_KINDS, carrier_of, entry_of, entry_shape, matrix_view
from megatron_p2r.optim.lion import Lion
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.memory import stage_state_bytes
from megatron_p2r.training import build_train_state, describe_memory, setup_parallel
from tests.helpers import run_steps
from tests.optim.common import cfg, fake_world


def _adafactor(params, shared=None, channels=(), pieces=None, **kw):
    pieces = pieces or {id(p): af.Piece(tuple(p.shape), 0, p.numel()) for p in params}
    return af.Adafactor(
        [{"params": params, "weight_decay": 0.1}], pieces, lr=0.01, shared=shared, channels=channels, **kw
    )


def _grads(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def test_adafactor_is_torchs_and_a_stack_is_its_matrices():
    """2-D and 1-D weights step as torch.optim.Adafactor's; a 3-D stack (experts) as torch's on
    each of its matrices."""
    shapes = [(6, 5), (7,), (3, 4, 5)]
    torch.manual_seed(0)
    ours = [torch.randn(s) for s in shapes]
    ref = [p.clone() for p in ours[:2]] + [p.clone() for p in ours[2]]
    opt, torch_opt = _adafactor(ours), torch.optim.Adafactor([{"params": ref, "weight_decay": 0.1}], lr=0.01)
    for grads in _grads(shapes, 4):
        for p, g in zip(ours, grads, strict=True):
            p.grad = g
        for p, g in zip(ref, grads[:2] + list(grads[2]), strict=True):
            p.grad = g.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ours[:2] + list(ours[2]), ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_matrix_cut_between_ranks_steps_as_the_whole():
    """A 6 x 5 matrix and a 7-vector cut mid-row into two pieces, each stepped by its own
    Adafactor whose sums are added to the other's: both pieces are the whole's elements, and
    both keep the whole matrix's row and column statistics."""
    shapes, cut = [(6, 5), (7,)], [13, 3]
    torch.manual_seed(0)
    whole = [torch.randn(s) for s in shapes]
    parts = [
        [p.detach().clone().view(-1)[:c].clone() for p, c in zip(whole, cut, strict=True)],
        [p.detach().clone().view(-1)[c:].clone() for p, c in zip(whole, cut, strict=True)],
    ]
    ref = _adafactor(whole)
    sums = _pair(shapes)
    opts = []
    for r, mine in enumerate(parts):
        pieces = {
            id(p): af.Piece(s, 0 if r == 0 else c, c if r == 0 else s[0] * (s[1] if len(s) > 1 else 1))
            for p, s, c in zip(mine, shapes, cut, strict=True)
        }
        shared = {id(p): (sums[r], i) for i, p in enumerate(mine)}
        opts.append(_adafactor(mine, shared, (sums[r],), pieces))
    for grads in _grads(shapes, 3):
        for p, g in zip(whole, grads, strict=True):
            p.grad = g
        for r, mine in enumerate(parts):
            for p, g, c in zip(mine, grads, cut, strict=True):
                p.grad = g.reshape(-1)[:c].clone() if r == 0 else g.reshape(-1)[c:].clone()
        ref.step()
        _step_together(opts)
    for p, c, a, b in zip(whole, cut, *parts, strict=True):
        torch.testing.assert_close(torch.cat([a, b]), p.detach().view(-1), rtol=1e-6, atol=1e-7)
    rows = [opts[r].state[parts[r][0]]["row_var"] for r in range(2)]
    torch.testing.assert_close(rows[0], ref.state[whole[0]]["row_var"], rtol=1e-6, atol=0)
    assert torch.equal(rows[0], rows[1])


class _SumPair(af.SharedPieces):
    """One of two 'ranks' in one process (a thread each): an all-reduce posts this rank's
    values, waits for the other's and returns their sum."""

    def __init__(self, shapes, barrier: threading.Barrier):
        super().__init__(None, list(shapes), torch.device("cpu"))
        self.barrier, self.other, self.posted = barrier, None, None

    def all_reduce(self, values):
        self.posted = values
        self.barrier.wait()
        total = values + self.other.posted
        self.barrier.wait()  # both have read before either posts again
        return total


def _pair(shapes):
    barrier = threading.Barrier(2)
    pair = [_SumPair(shapes, barrier) for _ in range(2)]
    pair[0].other, pair[1].other = pair[1], pair[0]
    return pair


def _step_together(opts):
    threads = [threading.Thread(target=o.step) for o in opts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_adafactor_statistics_round_trip_through_their_checkpoint_form():
    """The factored checkpoint entries (a matrix's rows and columns, a vector's variance), taken
    of fragments cut at any flat offset, tile the entry, hold R + C values per matrix, and give
    back the statistics bitwise."""
    shapes = [(6, 5), (7,), (3, 4, 5)]
    params = [torch.randn(s) for s in shapes]
    opt = _adafactor(params)
    for grads in _grads(shapes, 2):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    for p in params:
        piece, state = opt.pieces[id(p)], opt.state[p]
        kept, stored = {}, 0
        for kind in FACTOR_KINDS:
            carrier = af.checkpoint_value(state, piece, kind)
            entry = torch.cat(
                [entry_of(carrier[lo:hi], p.shape, kind, lo).reshape(-1) for lo, hi in ((0, 11), (11, p.numel()))]
            )
            assert entry.numel() == math.prod(entry_shape(p.shape, kind))
            stored += entry.numel()
            af.take_checkpoint_value(kept, piece, kind, 0, carrier_of(entry, p.shape, kind).reshape(-1))
        b, r, c = matrix_view(p.shape)
        assert stored == b * (r + c)
        for name, value in kept.items():
            assert torch.equal(value, state[name]), name


def test_lion_is_its_update_rule():
    torch.manual_seed(0)
    w = torch.randn(50)
    m, ref = torch.zeros(50), w.clone()
    opt = Lion([{"params": [w], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.99))
    for g in _grads([(50,)], 3):
        w.grad = g[0]
        opt.step()
        update = (0.9 * m + 0.1 * g[0]).sign()
        ref = ref * (1 - 0.01 * 0.1) - 0.01 * update
        m = 0.99 * m + 0.01 * g[0]
    torch.testing.assert_close(w, ref)
    torch.testing.assert_close(opt.state[w]["exp_avg"], m)


def test_lean_optimizers_refuse_moment_dtypes_they_do_not_keep():
    with pytest.raises(ConfigError, match="--optimizer lion keeps no second moment"):
        cfg(optimizer="lion", use_precision_aware_optimizer=True, exp_avg_sq_dtype="bf16").train.check()
    with pytest.raises(ConfigError, match="--optimizer adafactor keeps no moments"):
        cfg(optimizer="adafactor", use_precision_aware_optimizer=True, exp_avg_dtype="bf16").train.check()


def test_checkpoints_between_optimizers(tmp_path):
    """AdamW's checkpoint loads into Lion (its first moment becomes Lion's moment) and into
    Adafactor (the row and column means of its bias-corrected second moment become the
    statistics; a vector's is the variance), which trains on; Lion's into AdamW, and
    Adafactor's into Lion or AdamW, fail naming what is missing and the way out."""
    saved = {}
    for optimizer in ("adam", "lion", "adafactor"):
        _, state = run_steps(cfg(optimizer=optimizer), ParallelState.single(), 2)
        save_checkpoint(str(tmp_path / optimizer), state)
        saved[optimizer] = state
    adam = saved["adam"].optimizer.state
    weight, bias = (saved["adam"].model.get_parameter(n) for n in ("layers.0.mlp.fc1.weight", "layers.0.mlp.fc1.bias"))
    lion = build_train_state(cfg(optimizer="lion"), ParallelState.single())
    load_checkpoint(str(tmp_path / "adam"), lion)
    assert torch.equal(
        lion.optimizer.state[lion.model.get_parameter("layers.0.mlp.fc1.weight")]["exp_avg"], adam[weight]["exp_avg"]
    )
    adafactor = build_train_state(cfg(optimizer="adafactor"), ParallelState.single())
    load_checkpoint(str(tmp_path / "adam"), adafactor)
    stats = adafactor.optimizer.state[adafactor.model.get_parameter("layers.0.mlp.fc1.weight")]
    correction = 1 - cfg().train.adam_beta2 ** 2  # AdamW's bias correction after 2 steps
    second = adam[weight]["exp_avg_sq"] / correction
    close = dict(rtol=1e-6, atol=0)  # the statistics are ~1e-6: relative only
    torch.testing.assert_close(stats["row_var"], second.mean(1), **close)
    torch.testing.assert_close(stats["col_var"], second.mean(0), **close)
    torch.testing.assert_close(
        adafactor.optimizer.state[adafactor.model.get_parameter("layers.0.mlp.fc1.bias")]["variance"],
        adam[bias]["exp_avg_sq"] / correction,
        **close,
    )
    assert stats["step"] == 2
    losses, _ = run_steps(cfg(optimizer="adafactor"), ParallelState.single(), 2, load=str(tmp_path / "adam"))
    assert all(math.isfinite(x) for x in losses)
    for src, dst, missing in (
        ("lion", "adam", "exp_avg_sq"),
        ("adafactor", "lion", "exp_avg"),
        ("adafactor", "adam", "exp_avg, exp_avg_sq"),
    ):
        state = build_train_state(cfg(optimizer=dst), ParallelState.single())
        with pytest.raises(
            CheckpointError, match=f"holds {src} optimizer state .*--optimizer {dst} needs {missing}.*--no-load-optim"
        ):
            load_checkpoint(str(tmp_path / src), state)


@pytest.mark.parametrize("optimizer", ["lion", "adafactor"])
def test_resharded_there_and_back_the_state_is_the_same(tmp_path, optimizer):
    """Resharded to TP2 and back to TP1, a Lion or Adafactor checkpoint keeps its optimizer's
    entries (metadata optimizer_kinds) and loads into the optimizer's state bitwise."""
    _, saved = run_steps(cfg(optimizer=optimizer), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "tp1"), saved)
    convert(str(tmp_path / "tp1"), str(tmp_path / "tp2"), Target(tensor_parallel_size=2), None, progress=False)
    convert(str(tmp_path / "tp2"), str(tmp_path / "back"), Target(tensor_parallel_size=1), None, progress=False)
    state = build_train_state(cfg(optimizer=optimizer), ParallelState.single())
    load_checkpoint(str(tmp_path / "back"), state)
    for (name, p), q in zip(state.model.named_parameters(), saved.model.parameters(), strict=True):
        mine, theirs = state.optimizer.state[p], saved.optimizer.state[q]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name


def test_delink_rescales_adafactor_statistics(tmp_path):
    """A pseudo-phase Adafactor checkpoint (cycle:2: each slot called by 2 layers) delinked with
    ``rescale``: each real layer's row and column statistics are its slot's / 4, and the second
    moment they estimate too."""
    pseudo = dict(num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2", optimizer="adafactor")
    _, source = run_steps(cfg(**pseudo), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "pseudo"), source)
    convert(
        str(tmp_path / "pseudo"),
        str(tmp_path / "real"),
        Target(),
        DelinkOptions(optimizer_state="rescale"),
        progress=False,
    )
    real = build_train_state(cfg(**{**pseudo, "p2r_phase": "real"}), ParallelState.single())
    load_checkpoint(str(tmp_path / "real"), real)
    slot = source.optimizer.state[source.model.get_parameter("layers.1.mlp.fc1.weight")]
    for layer in (1, 3):
        mine = real.optimizer.state[real.model.get_parameter(f"layers.{layer}.mlp.fc1.weight")]
        for name in ("row_var", "col_var"):
            torch.testing.assert_close(mine[name], slot[name] / 4, rtol=1e-6, atol=0)
    norm = source.optimizer.state[source.model.get_parameter("layers.1.input_norm.weight")]["variance"]
    torch.testing.assert_close(
        real.optimizer.state[real.model.get_parameter("layers.3.input_norm.weight")]["variance"],
        norm / 4,
        rtol=1e-6,
        atol=0,
    )


MEASURED = [  # label, world, rank, flags
    (
        "dp2-adafactor-distopt-bf16-offload",
        2,
        1,
        dict(
            optimizer="adafactor",
            bf16=True,
            use_distributed_optimizer=True,
            ddp_bucket_size=1500,
            cpu_offload_layers="1",
        ),
    ),
    (
        "dp2-lion-distopt-fp16",
        2,
        0,
        dict(optimizer="lion", fp16=True, use_distributed_optimizer=True, ddp_bucket_size=1500),
    ),
    ("lion-bf16-moment", 1, 0, dict(optimizer="lion", use_precision_aware_optimizer=True, exp_avg_dtype="bf16")),
    (
        "moe-ep2-adafactor",
        2,
        1,
        dict(
            optimizer="adafactor",
            expert_model_parallel_size=2,
            num_experts=4,
            moe_ffn_hidden_size=24,
            use_distributed_optimizer=True,
        ),
    ),
]


@pytest.mark.parametrize("label,world,rank,flags", MEASURED, ids=[m[0] for m in MEASURED])
def test_bytes_a_rank_holds_are_the_planners(label, world, rank, flags):
    """Tensor accounting after a step (weights, gradient buffers, fp32 mains, the optimizer's
    state) equals the planner's exact figures for that rank."""
    c = cfg(**flags)
    with fake_world(world, rank):
        ps, plan = setup_parallel(c, torch.device("cpu"))
        state = build_train_state(c, ps, plan)
        state.optimizer.prepare_grads()
        state.optimizer.step()  # the optimizer allocates its state
        measured = describe_memory(state)
    planned = stage_state_bytes(plan, ps.pp_rank, ps.coords)
    assert (measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]) == (
        planned["params"],
        planned["grads"],
        planned["optimizer"],
    )
