"""The shipped example configs parse and validate for their layouts, without launching anything."""

import os

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import data_parallel_size, num_microbatches, validate

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
