"""An exported checkpoint loads in Megatron-LM and computes our logits (optional: needs megatron-core).

megatron_core_load.py runs with the interpreter named by ``P2R_MEGATRON_PYTHON`` (default: this
one), with ``P2R_MEGATRON_LM`` (a checkout of Megatron-LM, for ``megatron.training``, which the
megatron-core wheel lacks) on its path; the test is skipped when that interpreter cannot import
megatron-core and Megatron-LM's training code. Megatron builds the model from the exported args
alone (``--use-checkpoint-args``), loads the checkpoint with its own ``load_checkpoint`` (strict,
torch_dist without any --no-load-* flag: the args say there is nothing else to load; legacy with
--no-load-optim --no-load-rng), on 1 or 2 CPU ranks; its fp32 logits on random tokens are compared
with our one-process model's (the two differ only in reduction order). ``-s`` prints the figures
that docs/megatron.md quotes.
"""
import functools
import os
import subprocess
import sys

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.megatron.export_args import flags_to_pass
from megatron_p2r.convert.megatron.exporter import export_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, TorchArchive
from tests.convert.hf.common import GQA, ROPE, reference_model
from tests.convert.megatron.test_export import MODELS, _perturbed_state

# Options that --use-checkpoint-args does not restore (passed as the export's note says), Megatron's
# partial rotary, head dimension and QKV-only biases
QWEN_LIKE = dict(ROPE, **GQA, num_query_groups=2, kv_channels=16, rotary_percent=0.5, qk_layernorm=True,
                 norm_epsilon=1e-6, disable_bias_linear=True, add_qkv_bias=True,
                 untie_embeddings_and_output_weights=True)

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.environ.get("P2R_MEGATRON_PYTHON", sys.executable)
# (model, format, Megatron's TP, EP): the export written for that layout, loaded by that many ranks
CASES = [("gpt", "torch_dist", 1, 1), ("gpt", "torch", 2, 1), ("llama", "torch_dist", 2, 1),
         ("llama", "torch", 1, 1), ("moe", "torch_dist", 1, 2), ("moe", "torch", 2, 1), ("moe", "torch", 1, 2),
         ("qwen", "torch_dist", 2, 1)]


def _env():
    path = [p for p in (os.environ.get("P2R_MEGATRON_LM"), os.environ.get("PYTHONPATH")) if p]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))


@functools.lru_cache(maxsize=None)
def _megatron_missing():
    probe = subprocess.run([PYTHON, "-c", "import megatron.core, megatron.training.checkpointing"], env=_env(),
                           capture_output=True, text=True)
    return probe.returncode != 0


@pytest.mark.parametrize("model, fmt, tp, ep", CASES)
def test_megatron_loads_export_with_our_logits(model, fmt, tp, ep, tmp_path):
    if _megatron_missing():
        pytest.skip("megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, "
                    "P2R_MEGATRON_LM)")
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, _perturbed_state(MODELS.get(model, QWEN_LIKE)))
    out, _ = export_megatron(ours, str(tmp_path / "megatron"), ckpt_format=fmt, tp=tp, ep=ep, progress=False)
    reference, cfg = reference_model(ours, str(tmp_path / "single"))
    m = cfg.model
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    header = (os.path.join(out, "common.pt") if fmt == "torch_dist" else
              os.path.join(out, sorted(os.listdir(out))[0], "model_optim_rng.pt"))
    saved = TorchArchive(header, Kind.MEGATRON).obj["args"]
    flags = ["--vocab-size", str(m.vocab_size), *flags_to_pass(saved)]
    if fmt == "torch":
        flags += ["--no-load-optim", "--no-load-rng"]
    run = subprocess.run([PYTHON, os.path.join(HERE, "megatron_core_load.py"), str(tmp_path / "megatron"),
                          str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"), str(tp), str(ep), *flags],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "successfully loaded checkpoint" in run.stdout
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = reference(tokens=tokens)
    diff = (theirs - logits).abs().max().item()
    print(f"\n{model} {fmt} TP={tp} EP={ep}: max |logit difference| {diff:.2g} (logits up to "
          f"{logits.abs().max().item():.2g}), argmax agreement {(theirs.argmax(-1) == logits.argmax(-1)).float().mean():.0%}")
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)
