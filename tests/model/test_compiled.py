"""--compile: compiled layers reproduce the eager one-process model (loss and every gradient, fp32
tolerance: inductor fuses and reorders the arithmetic), and change no parameter name.

One process: selective recomputation (the attention core's checkpoint traced into the layer's
graph); an offloaded layer (run through ``functional_call`` with fetched weights) beside a MoE
layer (its routing breaks the graph: compiled in pieces, logged); recomputed dropout. Two ranks:
TP=2 with sequence parallelism and full recomputation, the gradients as training reduces them;
DP=2 with --overlap-param-gather (layers still one graph each). Compilation is slow on a small
CPU, so the models are the tiniest and the cases few.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_p2r.layout.ranks import Layout
from megatron_p2r.model import compiled
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from tests.harness import run_distributed
from tests.helpers import max_grad_error, random_microbatches, reference_grads, run_steps, tiny_config
from tests.pipeline.common import make_state, pipelined_step

TOL = 2e-5  # fp32, as the TP tests


def _cfg(**overrides):
    return tiny_config(compile=True, **overrides)


def _one_process_step(cfg, caplog):
    """(loss error, largest gradient error) of one compiled step against the eager model, and
    the compiled model's parameter names are the eager model's (checkpoints name these)."""
    mbs = random_microbatches(cfg, 2, 2)
    ref_loss, ref = reference_grads(cfg, mbs)  # eager, nothing offloaded
    ps = ParallelState.single()
    with caplog.at_level(logging.WARNING, logger="megatron_p2r.model.compiled"):
        model, loss = pipelined_step(cfg, ps, mbs, "1f1b")
    assert list(model.state_dict()) == list(build_model(cfg, ps).state_dict())
    return abs(loss - ref_loss), max(max_grad_error(model, ps, ref).values())


def test_one_process_selective_recompute_compiled_match_eager(caplog):
    loss_err, grad_err = _one_process_step(_cfg(recompute_activations=True), caplog)
    assert loss_err < 1e-5 and grad_err < TOL
    assert "does not trace as one graph" not in caplog.text  # one graph per layer


def test_offloaded_and_moe_layers_compiled_match_eager(caplog, monkeypatch):
    """An offloaded dense layer traces whole with its fetched weights as inputs; the MoE layer
    breaks the graph (logged). What is traced is dynamo's business, not the backend's:
    aot_eager (no code generation) spares inductor's compile time."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    loss_err, grad_err = _one_process_step(_cfg(num_experts=2, moe_layer_freq=[0, 1], cpu_offload_layers="0"), caplog)
    assert loss_err < 1e-5 and grad_err < TOL
    assert "layer 1 does not trace as one graph" in caplog.text and "layer 0" not in caplog.text


def test_selective_recompute_with_dropout_replays_the_masks(monkeypatch):
    """The attention core draws its dropout from the model-parallel stream, which dynamo cannot
    fork: under --compile it runs between graphs, recomputed with both streams replayed. With
    aot_eager the compiled layers draw the eager masks, so the two models agree bitwise."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    cfg = _cfg(recompute_activations=True, hidden_dropout=0.3, attention_dropout=0.3)
    ps = ParallelState.single()
    results = []
    for compile_layers in (False, True):
        seed_everything(cfg.train.seed, 0, 0, ps.device)
        model = build_model(cfg, ps)
        if compile_layers:
            compiled.compile_layers(model.layers)
        loss = forward_backward_no_pipelining(model, random_microbatches(cfg, 2, 2), ps)
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager), (loss, grads) = results
    assert loss == eager_loss
    assert all(torch.equal(grads[n], g) for n, g in eager.items())


def _overlapped_param_gather(rank, world):
    compiled.BACKEND = "aot_eager"  # a spawned rank: the test process's monkeypatch does not reach it
    ps = make_state(Layout(dp=2))
    runs = {}
    for compile_layers in (False, True):
        cfg = tiny_config(
            compile=compile_layers,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            overlap_grad_reduce=True,
            ddp_bucket_size=1000,
            global_batch_size=8,
        )
        seed_everything(cfg.train.seed, 0, 0, ps.device)
        runs[compile_layers] = run_steps(cfg, ps, 2)  # the second forward finds gathers pending
    (eager, _), (losses, state) = runs[False], runs[True]
    return {
        "losses": losses,
        "eager": eager,
        "whole": [layer.forward.pieces is None for layer in state.model.layers.values()],
    }


def test_overlapped_param_gather_waits_before_each_compiled_layer():
    """--overlap-param-gather: a compiled layer waits for all its buckets before its forward (a
    wait in a submodule's hook would break its graph); small buckets, so the gathers of later
    layers are still pending when a layer starts. aot_eager: what is checked is the tracing."""
    for r in run_distributed(_overlapped_param_gather, 2, timeout=400):
        assert r["losses"] == pytest.approx(r["eager"], rel=1e-6) and all(r["whole"]), r


def _tp2(rank, world):
    cfg = _cfg(
        num_layers=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=2,
    )
    mbs = random_microbatches(cfg, 2, 2)
    ps = make_state(Layout(tp=2))
    model, loss = pipelined_step(cfg, ps, mbs, "1f1b")
    ref_loss, ref = reference_grads(cfg, mbs)
    return {"loss_err": abs(loss - ref_loss), "grad_err": max(max_grad_error(model, ps, ref).values())}


def test_tp2_sequence_parallel_full_recompute_compiled_match_one_process():
    for r in run_distributed(_tp2, 2, timeout=400):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < TOL, r
