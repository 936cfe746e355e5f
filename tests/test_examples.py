"""The shipped example configs parse and validate for their layouts, without launching anything;
the DeepSeek-V3 example keeps its published parameter counts and its README quotes what its
planner commands print."""

import os
import re
import shlex

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import data_parallel_size, num_microbatches, validate
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning import memory
from tools.plan import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = ["--data-path", "corpus_text_document", "--tokenizer-model", "tok.model"]


@pytest.mark.parametrize(
    "example,phase", [(e, p) for e in ("m6_10t", "m6_1t") for p in ("pseudo", "real")] + [("m6_10t", "real_lean")]
)
def test_512_gpu_examples_validate(example, phase):
    folder = os.path.join(ROOT, "examples", example)
    cfg = parse_args(["--config", f"{folder}/model.yaml", f"{folder}/{phase}.yaml", *DATA])
    validate(cfg, 512)
    assert cfg.p2r.p2r_phase == phase.split("_")[0]
    p = cfg.parallel
    assert 512 % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) == 0
    assert data_parallel_size(cfg, 512) % p.expert_model_parallel_size == 0
    assert num_microbatches(cfg, 512) >= 1
    for script in ("launch.sh", "slurm.sbatch"):
        assert os.access(f"{folder}/{script}", os.X_OK)


@pytest.mark.parametrize("phase", ["pseudo", "real"])
def test_tiny_demo_configs_validate(phase):
    folder = os.path.join(ROOT, "examples", "tiny_p2r")
    cfg = parse_args(["--config", f"{folder}/model.yaml", f"{folder}/{phase}.yaml", *DATA, "--save", "ckpt"])
    world = {"pseudo": 8, "real": 4}[phase]  # as run_demo.sh launches them
    validate(cfg, world)
    assert cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size <= world


@pytest.mark.parametrize("phase", ["pseudo", "real"])
def test_deepseek_v3_example_validates_on_its_published_layout(phase):
    """2,048 GPUs: PP 16, EP 64 (8 nodes of 8), ZeRO-1 over DP 128, no TP (DeepSeek-V3's report)."""
    folder = os.path.join(ROOT, "examples", "deepseek_v3")
    cfg = parse_args(["--config", f"{folder}/model.yaml", f"{folder}/{phase}.yaml", *DATA])
    validate(cfg, 2048)
    p = cfg.parallel
    assert cfg.p2r.p2r_phase == phase and p.use_distributed_optimizer
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size) == (1, 16, 64)
    assert data_parallel_size(cfg, 2048) == 128 and num_microbatches(cfg, 2048) == 120
    for script in ("launch.sh", "slurm.sbatch"):
        assert os.access(f"{folder}/{script}", os.X_OK)


def _quoted_runs(readme: str):
    """(argv, quoted lines) of every ``p2r-plan`` block of ``readme`` and the output block after it."""
    with open(readme, encoding="utf-8") as fh:
        blocks = re.findall(r"```\n(.*?)```", fh.read(), re.S)
    for command, output in zip(blocks, blocks[1:], strict=False):
        if command.startswith("p2r-plan "):
            argv = shlex.split(command.replace("\\\n", " "))[1:]
            yield argv, [line.strip() for line in output.splitlines() if line.strip()]


def test_deepseek_v3_readme_quotes_what_its_commands_print(capsys):
    runs = list(_quoted_runs(os.path.join(ROOT, "examples", "deepseek_v3", "README.md")))
    assert len(runs) >= 3
    for argv, quoted in runs:
        plan_main(argv)
        printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
        assert [line for line in quoted if line not in printed] == [], argv


def test_deepseek_v3_parameter_counts_are_the_published_ones():
    """The planner's counts of model.yaml (the published, untied model) against the formula from
    DeepSeek-V3's config.json, which gives its published 671B (README) and about its 37B active."""
    h, vocab, expert = 7168, 129280, 3 * 7168 * 2048  # a SwiGLU expert of FFN 2048
    q, kv = h * 1536 + 1536 + 1536 * 128 * 192, h * (512 + 64) + 512 + 512 * 128 * (128 + 128)  # with latent norms
    attention = q + kv + 128 * 128 * h  # MLA
    dense, moe = attention + 2 * h + 3 * h * 18432, attention + 2 * h + 257 * expert + 256 * h  # + router
    main = 3 * dense + 58 * moe + 2 * vocab * h + h  # embedding, output layer, final norm
    mtp = moe + 2 * h * h + 3 * h  # its layer, 2h -> h projection, enorm, hnorm, final norm
    cfg = parse_args(["--config", os.path.join(ROOT, "examples", "deepseek_v3", "model.yaml")])
    plan = ParallelPlan.for_world(cfg, 1)
    assert memory.logical_parameter_count(plan) == main + mtp and memory.mtp_parameter_count(plan) == mtp
    assert round(main / 1e9) == 671 and round(mtp / 1e9, 1) == 11.6
    active = memory.active_parameter_count(plan)
    assert active == main - 58 * 248 * expert and abs(active / 37e9 - 1) < 0.015  # published 37B (36.7B)
    real = parse_args(["--config", f"{ROOT}/examples/deepseek_v3/model.yaml", f"{ROOT}/examples/deepseek_v3/real.yaml"])
    assert memory.logical_parameter_count(ParallelPlan.for_world(real, 2048)) == main + mtp  # untied, as published
