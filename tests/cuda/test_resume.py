"""Bitwise resume on CUDA with dropout on: the CUDA RNG state (default generator, and the
model-parallel stream of parallel/random.py) is saved and restored with the checkpoint.

4 steps straight == 2 steps + exit (saves) + resume + 2 steps, through ``pretrain`` itself:
same losses and the same bytes in every tensor file of the final checkpoint (weights, AdamW
state, RNG states). Deterministic algorithms are switched on for the test (CUDA's embedding
and attention backward otherwise accumulate with atomics); when the comparison fails, a second
straight run says whether CUDA itself is non-deterministic here (then the failure is not a
resume bug).
"""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from megatron_p2r.training import pretrain  # noqa: E402

pytestmark = pytest.mark.cuda

RESUME = dict(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    seq_length=128,
    vocab_size=1000,
    micro_batch_size=4,
    global_batch_size=8,
    train_iters=4,
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    clip_grad=1.0,
    weight_decay=0.01,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    log_interval=100,
    bf16=True,
)


def tensor_files(iter_dir: str) -> dict:
    """{relative path: bytes} of every safetensors file of a checkpoint iteration."""
    out = {}
    for root, _, files in os.walk(iter_dir):
        for f in files:
            if f.endswith(".safetensors"):
                path = os.path.join(root, f)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, iter_dir)] = fh.read()
    return out


def differing(a: dict, b: dict) -> list:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_resume_is_bitwise_with_cuda_rng_and_dropout(lane, tmp_path, record_property, deterministic):
    run = {name: str(tmp_path / name) for name in ("straight", "resumed", "again")}
    straight = pretrain(lane.config({**RESUME, "save": run["straight"]}))["losses"]
    first = pretrain(lane.config({**RESUME, "save": run["resumed"], "exit_interval": 2}))["losses"]
    second = pretrain(lane.config({**RESUME, "save": run["resumed"], "load": run["resumed"]}))["losses"]
    final = {name: tensor_files(os.path.join(path, "iter_0000004")) for name, path in run.items() if name != "again"}
    record_property("losses_straight", straight)
    record_property("losses_resumed", first + second)
    files = differing(final["straight"], final["resumed"])
    if first + second != straight or files:
        again = pretrain(lane.config({**RESUME, "save": run["again"]}))["losses"]
        repeatable = again == straight and not differing(
            final["straight"], tensor_files(os.path.join(run["again"], "iter_0000004"))
        )
        cause = (
            "a resume bug: two straight runs agree"
            if repeatable
            else "CUDA non-determinism here: two straight runs differ too (not a resume bug)"
        )
        pytest.fail(
            f"resumed run differs from the straight run ({cause}); losses {straight} vs {first + second}; "
            f"files that differ: {files}"
        )
    rng_files = [k for k in final["straight"] if "rng" in k]
    assert len(final["straight"]) >= 2 and rng_files, sorted(final["straight"])  # shard(s) and the RNG file
    lane.needs_cuda("a CUDA RNG state in the checkpoint")
    with safe_open(os.path.join(run["straight"], "iter_0000004", rng_files[0]), "pt") as f:
        assert any("cuda" in key for key in f.keys()), list(f.keys())
