"""What each spawned rank runs for the pipeline tests: one spawn per world size (4 and 8
ranks), many cases per spawn, since on this machine a spawn costs far more than a case.

Every case returns plain numbers (errors against the one-process reference, peak counts,
hashes); the tests in ``test_schedules.py`` / ``test_p2p.py`` assert on them, so each
property fails under its own test name. No pytest import here: ranks start faster.
"""

from __future__ import annotations

import hashlib
import traceback

import torch
import torch.distributed as dist

from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.pipeline.order import BACKWARD, FORWARD, Message
from megatron_p2r.pipeline.p2p import StageLink
from megatron_p2r.pipeline.transfers import Transfers
from megatron_p2r.pipeline import schedules
from megatron_p2r.training import reduce_loss
from tests.helpers import expected_shard, keep_first_step_grads, random_microbatches, reference_config, run_steps
from tests.pipeline.common import (
    UNEVEN_KEEP,
    compare_case,
    make_cfg,
    make_microbatches,
    make_state,
    pipelined_step,
    schedule_of,
    token_mean_reference,
)

P2P_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
P2P_SHAPES = ((2, 16, 32), (1, 12, 32), (5,), (3, 1, 2, 2))


def _payload(kind: str, dp: int, stage: int, i: int) -> torch.Tensor:
    """A tensor that names its sender, so the receiver can check what and from whom."""
    shape, dtype = P2P_SHAPES[i % len(P2P_SHAPES)], P2P_DTYPES[i % len(P2P_DTYPES)]
    base = {"fwd": 1000, "bwd": 2000}[kind] + 100 * dp + 10 * stage + i
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 7 + base).to(dtype)


def _spec(i: int) -> tuple:
    return P2P_SHAPES[i % len(P2P_SHAPES)], P2P_DTYPES[i % len(P2P_DTYPES)]


def p2p_checks(ps: ParallelState, rounds: int = 6) -> dict:
    """Every stage sends ``rounds`` named messages of varying shapes and dtypes forward and
    backward *before* receiving anything (sends never wait), then receives the forward ones
    last first (the link keeps those that arrive before they are asked for) and the backward
    ones in order, and checks what arrived and from whom."""
    s, dp, last = ps.pp_rank, ps.dp_rank, ps.pp_size - 1
    incoming = {}
    if s > 0:
        incoming[s - 1] = [Message(FORWARD, i, s) for i in range(rounds)]
    if s < last:
        incoming[s + 1] = [Message(BACKWARD, i, s) for i in range(rounds)]
    link = StageLink(ps, Transfers(incoming, {}, frozenset()), lambda msg: _spec(msg.microbatch))
    for i in range(rounds):
        if s < last:
            link.send(Message(FORWARD, i, s + 1), _payload("fwd", dp, s, i), s + 1)
        if s > 0:
            link.send(Message(BACKWARD, i, s - 1), _payload("bwd", dp, s, i), s - 1)
    ok = True
    for i in reversed(range(rounds)) if s > 0 else ():
        x, want = link.recv(Message(FORWARD, i, s), s - 1), _payload("fwd", dp, s - 1, i)
        ok &= x.dtype == want.dtype and torch.equal(x, want)
    for i in range(rounds) if s < last else ():
        g, want = link.recv(Message(BACKWARD, i, s), s + 1), _payload("bwd", dp, s + 1, i)
        ok &= g.dtype == want.dtype and torch.equal(g, want)
    link.wait()
    return {"ok": bool(ok)}


def count_messages(cfg, ps: ParallelState, microbatches, schedule: str) -> dict:
    """One pipelined step with every point-to-point send and receive counted: what a stage
    sends is the micro-batches' activations and gradients and nothing else (no headers);
    receives posted ahead (``irecv``) are counted apart from blocking ones."""
    sent, received, posted = [], [], []
    isend, recv, irecv = dist.isend, dist.recv, dist.irecv

    def counted(calls, call):
        def wrapper(t, peer, *args, **kwargs):
            calls.append(tuple(t.shape))
            return call(t, peer, *args, **kwargs)

        return wrapper

    dist.isend, dist.recv, dist.irecv = counted(sent, isend), counted(received, recv), counted(posted, irecv)
    try:
        pipelined_step(cfg, ps, microbatches, schedule)
    finally:
        dist.isend, dist.recv, dist.irecv = isend, recv, irecv
    return {"stage": ps.pp_rank, "sent": sent, "received": received, "posted": posted}


def equivalence_cases(ps: ParallelState, layout: Layout, cases, **data) -> dict:
    """Run ``cases`` [(label, cfg, schedule, n_micro)] against the reference (``data``:
    compare_case's keep and reference_fn); a label ending in /1f1b with a /gpipe twin also
    records whether their gradients are bitwise equal."""
    out, grads = {}, {}
    for label, cfg, schedule, n_micro in cases:
        r = compare_case(cfg, layout, ps, schedule, n_micro, **data)
        grads[label] = r.pop("grads")
        out[label] = r
    for label, mine in grads.items():
        twin = label.replace("/1f1b", "/gpipe")
        if label.endswith("/1f1b") and twin in grads:
            out[label]["same_as_gpipe"] = all(torch.equal(g, grads[twin][n]) for n, g in mine.items())
    return out


def train_replicas(cfg, ps: ParallelState, steps: int = 3) -> dict:
    """``steps`` train_step calls on mock data, here and on one process: per-step losses, the
    first step's largest gradient error, every parameter element's distance to the one-process
    run after the last step (and the largest), how far the weights moved, and a hash of this
    rank's tied-embedding replica."""
    init = {n: p.detach().clone() for n, p in build_model(cfg, ps).named_parameters()}
    grads, ref_grads = {}, {}
    losses, state = run_steps(cfg, ps, steps, after_step=keep_first_step_grads(grads))
    ref_losses, ref_state = run_steps(
        reference_config(cfg), ParallelState.single(), steps, after_step=keep_first_step_grads(ref_grads)
    )
    ref = {n: p.detach() for n, p in ref_state.model.named_parameters()}
    out = {
        "losses": losses,
        "ref_losses": ref_losses,
        "replica": None,
        "grad_err": 0.0,
        "param_errs": [],
        "moved": 0.0,
        "stage": ps.pp_rank,
        "dp": ps.dp_rank,
    }
    for name, p in state.model.named_parameters():
        logical = logical_name(name, p)
        want = expected_shard(ref[logical], p, ps)
        out["param_errs"] += (p.detach() - want).abs().flatten().tolist()
        out["grad_err"] = max(
            out["grad_err"], (grads[name] - expected_shard(ref_grads[logical], p, ps)).abs().max().item()
        )
        out["moved"] = max(out["moved"], (p.detach() - init[name]).abs().max().item())
        if logical == WORD_EMBEDDING:
            out["replica"] = hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
    out["param_err"] = max(out["param_errs"])
    return out


def train_overlapped(ps: ParallelState, steps: int = 3) -> dict:
    """``steps`` train_step calls of an interleaved model with and without
    --overlap-p2p-communication: per-step losses, a hash of this rank's weights after them, and
    how many receives were posted ahead (dist.irecv calls)."""
    cfg = make_cfg(pp=ps.pp_size, num_layers=4, num_layers_per_virtual_pipeline_stage=1, global_batch_size=8)
    out = {}
    for name, run_cfg in (("serial", cfg), ("overlapped", cfg.replace(overlap_p2p_communication=True))):
        posted, irecv = [], dist.irecv

        def counted_irecv(t, src, *args, **kwargs):
            posted.append(tuple(t.shape))
            return irecv(t, src, *args, **kwargs)

        dist.irecv = counted_irecv
        try:
            losses, state = run_steps(run_cfg, ps, steps)
        finally:
            dist.irecv = irecv
        weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in state.model.parameters()))
        out[name] = {"losses": losses, "weights": weights.hexdigest(), "posted": len(posted)}
    return out


def stage_peak_bytes(ps: ParallelState) -> dict:
    """Peak live bytes of this rank's step (beyond parameters and gradients, which are allocated
    before) with m micro-batches of one shape: 1F1B training and evaluation for m = 4, 8, 16,
    interleaved 1F1B training (8 layers, v = 2) for m = 8, 16, 24 (from m = 2P on, the warm-up is
    not cut short by m); one hidden tensor's bytes; 1F1B with sent outputs kept (m = 16)."""
    from tests.planning.test_planner import measure_step  # the planner tests' allocation tracker

    cfg = make_cfg(pp=ps.pp_size)
    b = cfg.train.micro_batch_size
    out = {"stage": ps.pp_rank, "hidden_bytes": b * cfg.model.seq_length * cfg.model.hidden_size * 4}
    runs = {
        "1f1b": (cfg, {}, (4, 8, 16)),
        "eval": (cfg, dict(forward_only=True), (4, 8, 16)),
        "interleaved": (cfg.replace(num_layers=8, num_layers_per_virtual_pipeline_stage=1), {}, (8, 16, 24)),
        "overlapped": (
            cfg.replace(num_layers=8, num_layers_per_virtual_pipeline_stage=1, overlap_p2p_communication=True),
            {},
            (8, 16, 24),
        ),
    }
    for name, (run_cfg, kwargs, counts) in runs.items():
        model, out[name] = build_model(run_cfg, ps), {}
        step = schedules.get_forward_backward_func(
            schedule_of("1f1b", ps.pp_size, model.num_model_chunks, run_cfg.parallel.overlap_p2p_communication)
        )
        for m in counts:
            mbs = random_microbatches(run_cfg, m, b, seed=m)
            _, out[name][m] = measure_step(model, run_cfg, lambda tracker: step(model, mbs, ps, **kwargs), mbs)
    keep = schedules.deallocate_output
    schedules.deallocate_output = lambda output: None  # sent outputs kept until their backward
    try:
        model, mbs = build_model(cfg, ps), random_microbatches(cfg, 16, b, seed=16)
        _, out["outputs_kept"] = measure_step(
            model,
            cfg,
            lambda tracker: schedules.get_forward_backward_func(schedule_of("1f1b", ps.pp_size, 1, False))(
                model, mbs, ps
            ),
            mbs,
        )
    finally:
        schedules.deallocate_output = keep
    return out


def _tie_schedule_cases(prefix: str, pp: int, n_micro: int) -> list:
    """Tied and untied embeddings, each with 1F1B and GPipe."""
    return [
        (
            f"{prefix}/{tie}/m{n_micro}/{schedule}",
            make_cfg(pp=pp, untie_embeddings_and_output_weights=tie == "untied"),
            schedule,
            n_micro,
        )
        for tie in ("tied", "untied")
        for schedule in ("1f1b", "gpipe")
    ]


def _fewer_microbatches_cases(prefix: str, pp: int, n_micro: int) -> list:
    """Fewer micro-batches than stages, with both schedules."""
    return [
        (f"{prefix}/tied/m{n_micro}/{schedule}", make_cfg(pp=pp), schedule, n_micro) for schedule in ("1f1b", "gpipe")
    ]


def _interleaved_cases(prefix: str, pp: int, n_micro: int, twin: bool = True, **overrides) -> list:
    """Interleaved 1F1B with two chunks per rank (one layer each) and, with ``twin``, the same
    model under plain 1F1B (label ``.../1f1b``: its gradients must be bitwise the same)."""
    cfg = make_cfg(pp=pp, num_layers=2 * pp, **overrides)
    cases = [
        (f"{prefix}/m{n_micro}/interleaved", cfg.replace(num_layers_per_virtual_pipeline_stage=1), "1f1b", n_micro)
    ]
    return cases + ([(f"{prefix}/m{n_micro}/1f1b", cfg, "1f1b", n_micro)] if twin else [])


def world4(rank: int, world: int) -> dict:
    """PP=4; TP=2 x PP=2; PP=2 x DP=2 (the PP=2 cases, with data parallelism on top)."""
    out = {"rank": rank}
    pp4 = Layout(pp=4)
    ps = make_state(pp4)
    out["p2p/pp4"] = p2p_checks(ps)
    cases = _tie_schedule_cases("pp4", pp=4, n_micro=5) + _fewer_microbatches_cases("pp4", pp=4, n_micro=2)
    cases.append(("pp4/split2,1,1,1/1f1b", make_cfg(pp=4, num_layers=5, pipeline_layer_split="2,1,1,1"), "1f1b", 3))
    cases += _interleaved_cases("pp4v2/tied", pp=4, n_micro=5)
    cases += _interleaved_cases("pp4v2/untied", pp=4, n_micro=3, untie_embeddings_and_output_weights=True)
    cases += _interleaved_cases(
        "pp4v2/pseudo-all", pp=4, n_micro=4, twin=False, p2r_phase="pseudo", share_pattern="all"
    )
    out["equiv"] = equivalence_cases(ps, pp4, cases)
    # In-flight activations on a P=4 pipeline with m=6 micro-batches.
    cfg = make_cfg(pp=4)
    mbs = make_microbatches(6, cfg.model.vocab_size)
    out["peak"] = {"stage": ps.pp_rank}
    for schedule in ("1f1b", "gpipe"):
        stats = {}
        pipelined_step(cfg, ps, mbs, schedule, stats=stats)
        out["peak"][schedule] = stats["peak_inflight"]
    out["peak_bytes"] = stage_peak_bytes(ps)
    out["messages"] = {
        "fixed": count_messages(
            cfg, ps, [make_microbatches(1, cfg.model.vocab_size, seed=i)[0] for i in range(3)], "1f1b"
        ),
        "varying": count_messages(cfg, ps, mbs[:3], "1f1b"),
    }
    interleaved = make_cfg(pp=4, num_layers=8, num_layers_per_virtual_pipeline_stage=1)
    out["messages"]["interleaved"] = count_messages(interleaved, ps, mbs, "1f1b")
    out["messages"]["overlapped"] = count_messages(interleaved.replace(overlap_p2p_communication=True), ps, mbs, "1f1b")

    tp2pp2 = Layout(tp=2, pp=2)
    ps = make_state(tp2pp2)
    out["equiv"].update(
        equivalence_cases(
            ps,
            tp2pp2,
            [
                ("tp2pp2/tied/1f1b", make_cfg(tp=2, pp=2), "1f1b", 3),
                ("tp2pp2/tied/gpipe", make_cfg(tp=2, pp=2), "gpipe", 3),
                ("tp2pp2/untied/1f1b", make_cfg(tp=2, pp=2, untie_embeddings_and_output_weights=True), "1f1b", 3),
            ]
            + _interleaved_cases("tp2pp2v2/tied", pp=2, n_micro=3, tp=2),
        )
    )

    pp2dp2 = Layout(pp=2, dp=2)
    ps = make_state(pp2dp2)
    out["p2p/pp2dp2"] = p2p_checks(ps)
    cases = _tie_schedule_cases("pp2dp2", pp=2, n_micro=3) + _fewer_microbatches_cases("pp2dp2", pp=2, n_micro=1)
    for split in ("1,3", "3,1"):
        cases.append((f"pp2dp2/split{split}/1f1b", make_cfg(pp=2, pipeline_layer_split=split), "1f1b", 2))
    cases.append(("pp2dp2/recompute/1f1b", make_cfg(pp=2, recompute_activations=True), "1f1b", 2))
    cases += _interleaved_cases("pp2dp2v2/tied", pp=2, n_micro=3)
    cases += _interleaved_cases("pp2dp2v2/untied", pp=2, n_micro=5, untie_embeddings_and_output_weights=True)
    # receives posted one op ahead (--overlap-p2p-communication), interleaved and plain 1F1B
    cases += _interleaved_cases(
        "pp2dp2v2/p2p-overlap",
        pp=2,
        n_micro=5,
        untie_embeddings_and_output_weights=True,
        overlap_p2p_communication=True,
    )
    cases.append(("pp2dp2/p2p-overlap/m3/gpipe", make_cfg(pp=2, overlap_p2p_communication=True), "gpipe", 3))
    # the same with --overlap-grad-reduce and small buckets: reductions start inside the backward
    cases += _interleaved_cases(
        "pp2dp2v2/overlap", pp=2, n_micro=3, twin=False, overlap_grad_reduce=True, ddp_bucket_size=1500
    )
    cases += _interleaved_cases(
        "pp2dp2v2/pseudo-all", pp=2, n_micro=3, twin=False, p2r_phase="pseudo", share_pattern="all"
    )
    out["equiv"].update(equivalence_cases(ps, pp2dp2, cases))
    bf16 = dict(pp=2, recompute_activations=True, bf16=True)
    out["bf16"] = equivalence_cases(
        ps,
        pp2dp2,
        [
            ("bf16/untied", make_cfg(**bf16, untie_embeddings_and_output_weights=True), "1f1b", 2),
            ("bf16/tied", make_cfg(**bf16), "1f1b", 2),
        ],
    )

    out["tokens"] = equivalence_cases(
        ps,
        pp2dp2,
        [("pp2dp2/tokens/1f1b", make_cfg(pp=2), "1f1b", 3)],
        keep=UNEVEN_KEEP,
        reference_fn=token_mean_reference,
    )

    # forward_only (evaluation): the token-mean loss, and no gradient anywhere.
    cfg = make_cfg(pp=2)
    all_mb = make_microbatches(4, cfg.model.vocab_size, seed=5, keep=UNEVEN_KEEP)
    model = build_model(cfg, ps)
    loss = reduce_loss(
        schedules.get_forward_backward_func(schedule_of("1f1b", ps.pp_size, 1, False))(
            model, all_mb[2 * ps.dp_rank : 2 * ps.dp_rank + 2], ps, forward_only=True
        ),
        ps,
    )
    out["eval"] = {
        "loss_err": abs(loss - token_mean_reference(cfg, all_mb, forward_only=True)[0]),
        "no_grads": all(p.grad is None for p in model.parameters()),
    }
    out["train"] = train_replicas(make_cfg(pp=2, global_batch_size=8), ps)
    out["train_overlap"] = train_overlapped(ps)

    dp4 = Layout(dp=4)
    ps = make_state(dp4)
    out["tokens"].update(
        equivalence_cases(
            ps, dp4, [("dp4/tokens", make_cfg(), "1f1b", 2)], keep=UNEVEN_KEEP, reference_fn=token_mean_reference
        )
    )

    # MoE layers with experts over EP=2, router aux and z losses (their backward scale is set
    # by the schedule); errors are reported, not raised, so they fail only test_moe_*.
    pp2ep2 = Layout(pp=2, dp=2, ep=2)
    ps = make_state(pp2ep2)
    moe = dict(pp=2, num_experts=4, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    try:
        out["moe"] = equivalence_cases(
            ps,
            pp2ep2,
            [("pp2ep2/moe/1f1b", make_cfg(**moe), "1f1b", 2), ("pp2ep2/moe/gpipe", make_cfg(**moe), "gpipe", 2)]
            + _interleaved_cases("pp2ep2v2/moe", n_micro=3, **moe)
            + _interleaved_cases(
                "pp2ep2v2/moe-p2p-overlap", n_micro=3, twin=False, overlap_p2p_communication=True, **moe
            ),
        )
    except Exception:  # noqa: BLE001 -- reported to the test as the traceback
        out["moe"] = traceback.format_exc()
    return out


def world8(rank: int, world: int) -> dict:
    """TP=2 x PP=2 x DP=2."""
    layout = Layout(tp=2, pp=2, dp=2)
    ps = make_state(layout)
    return {
        "equiv": equivalence_cases(
            ps,
            layout,
            [
                ("tp2pp2dp2/tied/1f1b", make_cfg(tp=2, pp=2), "1f1b", 2),
                ("tp2pp2dp2/untied/gpipe", make_cfg(tp=2, pp=2, untie_embeddings_and_output_weights=True), "gpipe", 2),
            ],
        )
    }
