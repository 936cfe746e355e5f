"""Multi-latent attention in the pseudo phase: a shared MLA slot, then delinked.

On 2 ranks: a pseudo model whose 4 layers share 2 MLA slots (cycle:2), under TP2 with sequence
parallelism, reproduces the one-process pseudo model (loss and every gradient shard: the
replicated down-projections' partial gradients summed over TP, then over the layers that share
them). Then tests/p2r/test_delink.py's run across layouts: pseudo training at TP2 + SP, delinked
into TP1 x PP2 and into one process; the eval loss is preserved, and the delinked run trains like
the one-process run (losses and every weight after 2 steps). Tolerances as there.
"""

import pytest
import torch

from megatron_p2r.training import setup_parallel
from tests.harness import run_distributed
from tests.helpers import tiny_config
from tests.model.test_latent_attention import MLA
from tests.p2r.test_delink import PSEUDO, _across_layouts
from tests.pipeline.common import compare_case

MODEL = dict(MLA, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
CASES = {
    "mla tp2-sp -> tp1pp2": (
        MODEL,
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2),
    ),
}


def _pseudo_rank(rank, world):
    cfg = tiny_config(**{**PSEUDO, **MODEL}, tensor_model_parallel_size=2, sequence_parallel=True)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    case = compare_case(cfg, ps.layout, ps, "1f1b", n_micro=2)
    return case["loss_err"], case["grad_err"], case["names"]


def test_shared_latent_attention_slots_reproduce_one_process():
    for loss_err, grad_err, names in run_distributed(_pseudo_rank, 2, timeout=600):
        assert loss_err < 1e-5 and grad_err < 2e-5, (loss_err, grad_err)
        assert "layers.1.attention.kv_down_proj.weight" in names and "layers.2.attention.q_up_proj.weight" not in names


def test_latent_attention_delinks_across_layouts(tmp_path):
    for rank, res in enumerate(run_distributed(_across_layouts, 2, str(tmp_path), CASES, timeout=600)):
        for name in CASES:
            pseudo_eval, real_eval, pseudo_next, real_next, one_next, weight_err = res[name]
            assert real_eval == pytest.approx(pseudo_eval, rel=1e-5), name
            assert real_next[0] == pytest.approx(pseudo_next[0], rel=1e-5), name
            assert real_next == pytest.approx(one_next, rel=1e-5), (name, real_next, one_next)
            assert weight_err <= 2e-5, (name, rank, weight_err)
