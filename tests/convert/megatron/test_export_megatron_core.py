"""An exported checkpoint loads in Megatron-LM and computes our logits (optional: needs megatron-core).

megatron_core_load.py runs with the interpreter named by ``P2R_MEGATRON_PYTHON`` (default: this
one), with ``P2R_MEGATRON_LM`` (a checkout of Megatron-LM, for ``megatron.training``, which the
megatron-core wheel lacks) on its path; the test is skipped when that interpreter cannot import
megatron-core and Megatron-LM's training code. Megatron builds the model from the exported args
alone (``--use-checkpoint-args``), loads the checkpoint with its own ``load_checkpoint`` (strict,
torch_dist without any --no-load-* flag: the args say there is nothing else to load; legacy with
--no-load-optim --no-load-rng), on 1 or 2 CPU ranks; its fp32 logits on random tokens are compared
with our one-process model's (the two differ only in reduction order). ``-s`` prints the figures
that docs/evidence/megatron.md quotes. Run as a module, it rewrites megatron_core_keys.json, which
test_export.py compares the torch_dist keys with in every run.
"""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.tensor_table import tensor_table
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.megatron.export_args import flags_to_pass
from megatron_p2r.convert.megatron.export_optim import scheduler_flags
from megatron_p2r.convert.megatron.exporter import export_megatron
from megatron_p2r.convert.megatron.names import bias_megatron_name
from megatron_p2r.convert.megatron.rules import to_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, TorchArchive
from tests.convert.hf.common import reference_model
from tests.convert.megatron.test_export import EXPECTED_KEYS, MODELS, _perturbed_state
from tests.convert.megatron.test_export_optimizer import SCHEDULE, trained
from tests.helpers import tiny_config

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.environ.get("P2R_MEGATRON_PYTHON", sys.executable)
# (model, format, Megatron's TP, EP): the export written for that layout, loaded by that many ranks
CASES = [
    ("gpt", "torch_dist", 1, 1),
    ("gpt", "torch", 2, 1),
    ("llama", "torch_dist", 2, 1),
    ("llama", "torch", 1, 1),
    ("moe", "torch_dist", 1, 2),
    ("moe", "torch", 2, 1),
    ("moe", "torch", 1, 2),
    ("qwen", "torch_dist", 2, 1),
    ("gptoss", "torch_dist", 2, 1),
    ("gptoss", "torch", 1, 2),
    ("deepseek", "torch_dist", 1, 2),
    ("deepseek", "torch", 2, 1),
]


def _env():
    path = [p for p in (os.environ.get("P2R_MEGATRON_LM"), os.environ.get("PYTHONPATH")) if p]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))


@functools.lru_cache(maxsize=None)
def _megatron_missing():
    probe = subprocess.run(
        [PYTHON, "-c", "import megatron.core, megatron.training.checkpointing"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    return probe.returncode != 0


@pytest.mark.parametrize("model, fmt, tp, ep", CASES)
def test_megatron_loads_export_with_our_logits(model, fmt, tp, ep, tmp_path):
    if _megatron_missing():
        pytest.skip(
            "megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, P2R_MEGATRON_LM)"
        )
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, _perturbed_state(MODELS[model]))
    out, _ = export_megatron(ours, str(tmp_path / "megatron"), ckpt_format=fmt, tp=tp, ep=ep, progress=False)
    reference, cfg = reference_model(ours, str(tmp_path / "single"))
    m = cfg.model
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    assert "successfully loaded checkpoint" in _run_megatron(
        out, tmp_path / "tokens.pt", tmp_path / "logits.pt", fmt, tp, ep, m.vocab_size
    )
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = reference(tokens=tokens)
    diff = (theirs - logits).abs().max().item()
    print(
        f"\n{model} {fmt} TP={tp} EP={ep}: max |logit difference| {diff:.2g} (logits up to "
        f"{logits.abs().max().item():.2g}), argmax agreement {(theirs.argmax(-1) == logits.argmax(-1)).float().mean():.0%}"
    )
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)
    if m.moe_router_enable_expert_bias:  # Megatron's routers hold our biases, bit for bit
        loaded = torch.load(f"{tmp_path / 'logits.pt'}.expert_bias", weights_only=True)
        ours = {n: b for n, b in reference.named_buffers() if n.endswith(".expert_bias")}
        assert any(n.startswith("mtp.") for n in ours) == bool(m.mtp_num_layers)
        assert ours and all(b.abs().min() > 0 for b in ours.values())
        for name, bias in ours.items():
            assert torch.equal(loaded[bias_megatron_name(name).removesuffix(".expert_bias")], bias), name


@pytest.mark.parametrize("model, ep", [("gpt", 1), ("gptoss", 1), ("gptoss", 2), ("deepseek", 2)])
def test_megatron_resumes_from_export_with_our_next_step(tmp_path, model, ep):
    """Our run after 3 AdamW steps (cosine warm-up, weight decay, beta2 0.95) exported with its
    optimizer state: Megatron loads model, optimizer and scheduler with its own load_checkpoint
    (strict, its non-distributed optimizer, its flags' schedule checked against the checkpoint's;
    beta2 is the checkpoint's, as Megatron takes it from the saved groups) and takes one step on a
    batch; ours from our checkpoint on the same batch gives the same logits, and from the weights
    alone with a fresh AdamW it does not. The gpt-oss-like MoE (windows, sinks, clamped
    quick-GeGLU experts) resumes under EP 1 (one optimizer) and EP 2 (megatron-core's chained
    optimizer of the dense parameters and the experts; 2 ranks of one sample each)."""
    if _megatron_missing():
        pytest.skip(
            "megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, P2R_MEGATRON_LM)"
        )
    options = {} if model == "gpt" else MODELS[model]
    ours = trained(str(tmp_path / "ours"), options)
    out, _ = export_megatron(ours, str(tmp_path / "megatron"), ep=ep, progress=False)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "tokens": torch.randint(0, 200, (2, 16), generator=g),
        "batch": torch.randint(0, 200, (2, 17), generator=g),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    # the schedule the export's note says to pass (its global batch of 2 is the harness's both ways)
    schedule = scheduler_flags(SourceCheckpoint(ours).real_cfg, 1) + ["--clip-grad", "0"]
    if ep == 1:  # one rank takes the batch of 2 (under EP 2: 2 data-parallel ranks of 1, the harness's)
        schedule += ["--micro-batch-size", "2"]
    assert "successfully loaded checkpoint" in _run_megatron(
        out, tmp_path / "inputs.pt", tmp_path / "logits.pt", "torch_dist", 1, ep, 200, schedule
    )
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    continued = _our_next_logits(ours, inputs, **options)
    diff = (theirs - continued).abs().max().item()
    print(
        f"\n{model} EP={ep} resumed in Megatron: max |logit difference| after its next step {diff:.2g} (logits up to "
        f"{continued.abs().max().item():.2g})"
    )
    torch.testing.assert_close(theirs, continued, rtol=1e-5, atol=1e-5)
    assert (theirs - _our_next_logits(ours, inputs, no_load_optim=True, **options)).abs().max() > 1e-3


def test_megatron_loads_bf16_export_with_our_mains_and_moments(tmp_path):
    """A --bf16 run of ours exported with --dtype bfloat16: Megatron under --bf16 (a Float16Module,
    Float16OptimizerWithFloat16Params) loads it, and the fp32 mains and moments its optimizer holds
    are ours, bit for bit, in Megatron's layout (the export's own reordering, tested by the round
    trip); its next step runs."""
    if _megatron_missing():
        pytest.skip(
            "megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, P2R_MEGATRON_LM)"
        )
    options = dict(MODELS["llama"], bf16=True)
    ours = trained(str(tmp_path / "ours"), options)
    out, _ = export_megatron(ours, str(tmp_path / "megatron"), dtype="bfloat16", progress=False)
    g = torch.Generator().manual_seed(0)
    torch.save(
        {
            "tokens": torch.randint(0, 200, (2, 16), generator=g),
            "batch": torch.randint(0, 200, (2, 17), generator=g),
            "state_out": str(tmp_path / "state.pt"),
        },
        tmp_path / "inputs.pt",
    )
    schedule = [
        "--bf16",
        "--lr",
        "0.01",
        "--lr-warmup-iters",
        "5",
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.1",
        "--train-iters",
        "10",
        "--clip-grad",
        "0",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
    ]
    assert "successfully loaded checkpoint" in _run_megatron(
        out, tmp_path / "inputs.pt", tmp_path / "logits.pt", "torch_dist", 1, 1, 200, schedule
    )
    theirs = torch.load(tmp_path / "state.pt", weights_only=True)
    source = SourceCheckpoint(ours)
    plan = to_megatron(list(tensor_table(source.real_cfg)), source.real_cfg.model)
    assert sorted(theirs) == sorted(plan)
    for name, (keys, fn) in plan.items():
        for kind, ours_kind in (("main", "model"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(theirs[name][kind], fn([source.read(k, ours_kind) for k in keys])), (name, kind)


def _our_next_logits(ours, inputs, **flags):
    """Our logits on ``inputs["tokens"]`` after one step on ``inputs["batch"]`` from checkpoint ``ours``."""
    from megatron_p2r.checkpoint.io import load_checkpoint
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state, train_step

    state = build_train_state(tiny_config(**SCHEDULE, **flags), ParallelState.single(), None)
    load_checkpoint(ours, state)
    batch = inputs["batch"]
    train_step(state, [{"tokens": batch[:, :-1], "labels": batch[:, 1:], "loss_mask": torch.ones(2, 16)}])
    with torch.no_grad():
        return state.model.eval()(tokens=inputs["tokens"]).float()


def _run_megatron(iter_dir, tokens, out, fmt, tp, ep, vocab, extra=()):
    """megatron_core_load.py on the export (flags: what the export's note says to pass, and ``extra``)."""
    header = (
        os.path.join(iter_dir, "common.pt")
        if fmt == "torch_dist"
        else os.path.join(iter_dir, sorted(os.listdir(iter_dir))[0], "model_optim_rng.pt")
    )
    flags = ["--vocab-size", str(vocab), *flags_to_pass(TorchArchive(header, Kind.MEGATRON).obj["args"])]
    if fmt == "torch":
        flags += ["--no-load-optim", "--no-load-rng"]
    flags += list(extra)
    run = subprocess.run(
        [
            PYTHON,
            os.path.join(HERE, "megatron_core_load.py"),
            os.path.dirname(iter_dir),
            str(tokens),
            str(out),
            str(tp),
            str(ep),
            *flags,
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def write_expected_keys(tmp):
    """EXPECTED_KEYS: for each model of test_export.py, the sharded keys megatron-core's GPTModel
    (built from the export's args) asks a torch_dist checkpoint for."""
    expected = {}
    for model, options in MODELS.items():
        ours = os.path.join(tmp, model)
        save_checkpoint(ours, _perturbed_state(options))
        out, _ = export_megatron(ours, os.path.join(tmp, model + "_megatron"), progress=False)
        keys = os.path.join(tmp, model + ".json")
        _run_megatron(out, keys, keys, "torch_dist", 1, 1, tiny_config(**options).model.vocab_size)
        with open(keys) as fh:
            expected[model] = json.load(fh)
    with open(EXPECTED_KEYS, "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":  # python -m tests.convert.megatron.test_export_megatron_core (with P2R_MEGATRON_*)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_expected_keys(tmp)
    print(f"wrote {EXPECTED_KEYS}")
