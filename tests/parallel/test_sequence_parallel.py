"""--sequence-parallel reproduces the one-process model: TP=2 and TP=4, a GPT-style (tied,
learned positions, LayerNorm, biases) and a Llama-style (untied, RoPE, RMSNorm, SwiGLU, no
biases) model; with PP=2 (1F1B, stages exchange the sequence shard); with MoE and EP=2
(aux and z losses on); with dropout (each rank's masks come from its model-parallel stream).

Every case compares the loss and *every* gradient as training reduces it (the DDP's gradient
buffers, ``main_grad``: the norms, the biases added after a reduce-scatter, the router and the
position embedding get partial gradients on each TP rank: without their TP all-reduce the
comparison fails), on micro-batches of different shapes with a loss mask
(``tests.pipeline.common``). Tolerance: fp32, the order of reductions changes, 2e-5 absolute
on gradients (as the TP tests), 1e-5 on the loss.
Recomputation with dropout under sequence parallelism is compared bitwise.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_p2r.arguments import resolve_values
from megatron_p2r.config import ConfigError, validate
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.mappings import all_gather_sequence
from megatron_p2r.parallel.random import get_rng_tracker, seed_everything
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from tests.harness import run_distributed
from tests.helpers import max_grad_error, random_microbatches, reference_config
from tests.moe.workers import moe_model
from tests.pipeline.common import compare_case, make_cfg, make_state, pipelined_step

VARIANTS = {
    "gpt": {},
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
    ),
}
DROPOUT = 0.3


def _compare(cfg, layout, ps, n_micro: int) -> dict:
    r = compare_case(cfg, layout, ps, "1f1b", n_micro)
    r.pop("grads")  # numbers only travel back to the test process
    return r


def _variant_cases(ps, layout, tp: int, pp: int = 1, n_micro: int = 2) -> dict:
    return {
        f"tp{tp}pp{pp}/{name}": _compare(
            make_cfg(tp=tp, pp=pp, sequence_parallel=True, **overrides), layout, ps, n_micro
        )
        for name, overrides in VARIANTS.items()
    }


class _Dropout:
    """``F.dropout`` that records each call's keep mask, or (``replay``) applies given masks."""

    def __init__(self, replay=None):
        self.masks, self.replay, self.real = [], replay, F.dropout

    def __call__(self, x, p=0.5, training=True, inplace=False):
        if p == 0 or not training:
            return x
        if self.replay is not None:
            mask = self.replay[len(self.masks)]
            self.masks.append(mask)
            return x * mask / (1 - p)
        out = self.real(x, p, training)
        self.masks.append(out.detach() != 0)
        return out

    def run(self, fn):
        F.dropout = self
        try:
            return fn()
        finally:
            F.dropout = self.real


def _dropout_case() -> dict:
    """TP=2 with sequence parallelism and hidden dropout: the masks each rank drew, gathered
    along the sequence and replayed in the one-process model, give its loss and gradients;
    they are the masks this rank's model-parallel stream draws, so the two TP ranks' shards of
    a mask differ (from the default stream, seeded alike on TP peers, they would be equal)."""
    cfg = make_cfg(tp=2, sequence_parallel=True, hidden_dropout=DROPOUT)
    plan = ParallelPlan.for_world(cfg, 2)
    ps = make_state(plan.layout)
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    mbs = random_microbatches(cfg, 1, 2)
    recorder = _Dropout()
    model, loss = recorder.run(lambda: pipelined_step(cfg, ps, mbs, "1f1b"))
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)  # the streams as training starts them
    with get_rng_tracker(ps.device).fork():
        drawn = [torch.empty(m.shape).bernoulli_(1 - DROPOUT) != 0 for m in recorder.masks]
    full = [all_gather_sequence(m.float(), ps.group("tp")) for m in recorder.masks]
    halves = [m.chunk(2, dim=1) for m in full]

    reference = build_model(reference_config(cfg), ParallelState.single())
    replay = _Dropout(replay=full)
    ref_loss = replay.run(lambda: forward_backward_no_pipelining(reference, mbs, ParallelState.single()).item())
    errors = max_grad_error(model, ps, {logical_name(n, p): p.grad for n, p in reference.named_parameters()})
    return {
        "calls": len(recorder.masks),
        "replayed": len(replay.masks),
        "loss_err": abs(loss - ref_loss),
        "grad_err": max(errors.values()),
        "from_stream": all(torch.equal(m, d) for m, d in zip(recorder.masks, drawn, strict=True)),
        "shards_differ": all(not torch.equal(a, b) for a, b in halves),
    }


RECOMPUTE = {
    "selective": dict(recompute_activations=True),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
}


def _recompute_case(ps) -> dict:
    """Selective and full recomputation with hidden and attention dropout reproduce no
    recomputation bitwise under sequence parallelism (both streams replayed)."""
    grads = {}
    for name, flags in {"none": {}, **RECOMPUTE}.items():
        cfg = make_cfg(tp=2, sequence_parallel=True, hidden_dropout=DROPOUT, attention_dropout=DROPOUT, **flags)
        seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps)
        forward_backward_no_pipelining(model, random_microbatches(cfg, 2, 2), ps)
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    return {name: all(torch.equal(g, grads["none"][n]) for n, g in grads[name].items()) for name in RECOMPUTE}


def _world2(rank, world):
    ps = make_state(Layout(tp=2))
    out = _variant_cases(ps, Layout(tp=2), tp=2)
    out["recompute_bitwise"] = _recompute_case(ps)
    out["dropout"] = _dropout_case()
    return out


def _world4(rank, world):
    """TP=4; TP=2 x PP=2 (with each stage's hidden spec); TP=2 x EP=2 MoE."""
    out = _variant_cases(make_state(Layout(tp=4)), Layout(tp=4), tp=4)
    layout = Layout(tp=2, pp=2)
    ps = make_state(layout)
    out.update(_variant_cases(ps, layout, tp=2, pp=2, n_micro=3))
    cfg = make_cfg(tp=2, pp=2, sequence_parallel=True)
    out["hidden_spec"] = build_model(cfg, ps, ParallelPlan.build(cfg, layout)).hidden_spec((2, 16))
    layout = Layout(tp=2, dp=2, ep=2)
    ps = make_state(layout)
    for name, overrides in {"dropless": {}, "capacity-drops": dict(moe_capacity_factor=0.5, swiglu=True)}.items():
        out[f"tp2ep2/moe-{name}"] = _compare(moe_model(tp=2, ep=2, sequence_parallel=True, **overrides), layout, ps, 1)
    return out


def _assert_equivalent(case: str, ranks: list) -> None:
    """Loss and gradients on every rank; the ranks' parameters together are all of the model's."""
    for r in ranks:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 2e-5, (case, r["loss_err"], r["grad_err"])
    assert sorted({n for r in ranks for n in r["names"]}) == ranks[0]["ref_names"], case


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, 2)


def test_sequence_parallel_tp2_reproduces_one_process(world2):
    for case in ("tp2pp1/gpt", "tp2pp1/llama"):
        _assert_equivalent(case, [out[case] for out in world2])


def test_sequence_parallel_dropout_draws_from_the_model_parallel_stream(world2):
    for out in world2:
        assert out["recompute_bitwise"] == {"selective": True, "full": True}, out["recompute_bitwise"]
        d = out["dropout"]
        assert d["calls"] == d["replayed"] == 9, d  # the embedding and 2 in each of the 4 layers
        assert d["from_stream"] and d["shards_differ"], d
        assert d["loss_err"] < 1e-5 and d["grad_err"] < 2e-5, d


def test_sequence_parallel_tp4_pp2_and_moe_ep2_reproduce_one_process():
    results = run_distributed(_world4, 4, timeout=400)
    for case in results[0]:
        if case != "hidden_spec":
            _assert_equivalent(case, [out[case] for out in results])
    # stages exchange 1/TP of the sequence: [b, s/TP, h]
    assert results[0]["hidden_spec"] == ((2, 8, 32), torch.float32)


def test_sequence_parallel_flags_are_checked():
    with pytest.raises(ConfigError, match=r"--seq-length \(18\) must be divisible by"):
        validate(make_cfg(sequence_parallel=True, tensor_model_parallel_size=4, seq_length=18), 4)


def test_sequence_parallel_with_tp1_has_no_effect_as_in_megatron():
    """Megatron-LM turns --sequence-parallel off with TP 1 (its Llama-3 and Mixtral launch
    scripts pass both): the run is accepted, planned and built without it, and the flag is
    reported once as having no effect."""
    cfg = make_cfg(sequence_parallel=True)
    validate(cfg, 1)
    assert not ParallelPlan.build(cfg, Layout()).sequence_parallel
    _, no_effect = resolve_values(dict(sequence_parallel=True))
    assert [f for f in no_effect if f.startswith("--sequence-parallel (")] != []
    assert resolve_values(dict(sequence_parallel=True, tensor_model_parallel_size=2))[1] == []
