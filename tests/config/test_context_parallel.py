"""--context-parallel-size and --cp-comm-type: Megatron-LM's rules, and every composition not built
with CP refused by name (one error line at the command line)."""

import pytest

from megatron_p2r.arguments import parse_launch
from megatron_p2r.config import ConfigError, data_parallel_size, validate
from tests.helpers import bad_input_error, tiny_config


def test_cp_takes_ranks_from_data_parallelism():
    cfg = tiny_config(context_parallel_size=2, tensor_model_parallel_size=2)
    assert data_parallel_size(cfg, 8) == 2
    validate(cfg.replace(global_batch_size=4), 8)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (dict(context_parallel_size=3), 3, r"--seq-length \(16\) must be a multiple of 2 x CP"),
        (
            dict(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True, seq_length=12),
            8,
            r"a CP rank's 6 tokens \(--seq-length / CP\) must split evenly over --tensor-model-parallel-size \(4\)",
        ),
        (dict(context_parallel_size=2), 3, r"divisible by .* x --context-parallel-size \(2\) = 2"),
        (dict(context_parallel_size=2, overlap_moe_expert_parallel_comm=True), 2, "not built with --overlap-moe"),
        (dict(context_parallel_size=2, compile=True), 2, "not built with --compile"),
        (
            dict(
                context_parallel_size=2,
                multi_latent_attention=True,
                q_lora_rank=8,
                kv_lora_rank=8,
                qk_head_dim=4,
                qk_pos_emb_head_dim=4,
                v_head_dim=4,
                position_embedding_type="rope",
            ),
            2,
            "not built with --multi-latent-attention",
        ),
        (
            dict(
                context_parallel_size=2,
                num_experts=4,
                moe_router_topk=2,
                moe_aux_loss_coeff=0.01,
                moe_router_load_balancing_type="seq_aux_loss",
            ),
            2,
            "not built with --moe-router-load-balancing-type seq_aux_loss",
        ),
        (dict(context_parallel_size=2, mtp_num_layers=1), 2, "not built with --mtp-num-layers"),
    ],
)
def test_what_cp_cannot_do_is_refused_by_name(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**flags), world)


def test_cp_comm_type_is_megatrons_and_hierarchical_is_refused(capsys):
    assert tiny_config().parallel.cp_comm_type == "p2p"
    base = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32"]
    assert parse_launch(base + ["--cp-comm-type", "allgather"])[0].parallel.cp_comm_type == "allgather"
    with pytest.raises(ConfigError, match="--cp-comm-type a2a\\+p2p: .*hierarchical"):
        parse_launch(base + ["--cp-comm-type", "a2a+p2p"])
    import pretrain_m6

    argv = base + ["--num-attention-heads", "4", "--train-iters", "1", "--context-parallel-size", "2"]
    assert "world size 1 must be divisible by" in bad_input_error(pretrain_m6.main, argv, capsys)
