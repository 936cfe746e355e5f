"""``p2r-plan --max-seq-length``: the search over lengths (a pure function of a verdict) and its
answer on the real planner: the length it returns fits and the next one does not."""

from __future__ import annotations

import pytest

from megatron_p2r.arguments import config_from_values
from megatron_p2r.planning import estimate, hardware
from megatron_p2r.planning.longest_sequence import at_length, longest_sequence, plan_verdict, sequence_step
from tests.planning.test_planner import SMALL
from tools.plan import check, main, planner_parser


def threshold(limit: int):
    return lambda tokens: (tokens <= limit, f"over {limit}")


@pytest.mark.parametrize("limit", [1, 511, 512, 513, 1024, 5000, 12_345, 65_536, 1_000_000])
@pytest.mark.parametrize("step", [1, 128, 512])
def test_search_finds_the_last_multiple_that_fits(limit, step):
    found = longest_sequence(threshold(limit), step, limit_tokens=2**22)
    expected = limit // step * step
    assert found.tokens == (expected or None)
    asked = dict(found.tried)
    assert all(t % step == 0 for t in asked) and all(ok == (t <= limit) for t, ok in asked.items())
    if found.tokens:  # the answer fits and the next length was asked and refused
        assert asked[found.tokens] and asked[found.tokens + step] is False
        assert found.limit == f"at {found.tokens + step:,} tokens: over {limit}"
    assert len(found.tried) <= 2 * (limit // step + 1).bit_length() + 2


def test_search_stops_at_its_limit_and_when_nothing_fits():
    found = longest_sequence(threshold(10**9), 512, limit_tokens=4096)
    assert found.tokens == 4096 and "limit" in found.limit
    none = longest_sequence(threshold(100), 512)
    assert none.tokens is None and none.limit == "over 100" and none.tried == ((512, False),)


def test_sequence_step_is_what_the_layout_needs():
    cfg = config_from_values({**SMALL, "tensor_model_parallel_size": 3, "sequence_parallel": True})
    assert sequence_step(cfg, 512) == 1536
    assert sequence_step(cfg.replace(sequence_parallel=False), 512) == 512


def test_planner_answer_fits_and_the_next_length_does_not():
    """On a small model on a GPU of 600 MiB, the planner itself (checks and plan) at the answer
    and one step beyond: the activations outgrow the memory."""
    cfg = config_from_values({**SMALL, "micro_batch_size": 4, "position_embedding_type": "rope"})
    gpu = hardware.GPU_PRESETS["H100-80GB"].replace(memory=600 * 2**20)

    def plan_of(c):
        check(c, 1)
        return estimate.make_plan(c, 1, gpu, reserve=0)

    found = longest_sequence(plan_verdict(cfg, plan_of), 256)
    assert found.tokens is not None and found.tokens >= 1024
    assert plan_of(at_length(cfg, found.tokens)).fits
    beyond = plan_of(at_length(cfg, found.tokens + 256))
    assert not beyond.fits and f"at {found.tokens + 256:,} tokens" in found.limit and "'activations'" in found.limit


def test_learned_positions_grow_with_the_length():
    cfg = config_from_values({**SMALL, "max_position_embeddings": 64})
    assert at_length(cfg, 4096).model.max_positions == 4096 and at_length(cfg, 16).model.max_positions == 64


def test_cli_prints_each_phase_longest_sequence(capsys):
    argv = [
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",
        "--micro-batch-size", "8", "--global-batch-size", "8", "--vocab-size", "1000", "--mock-data",
        "--position-embedding-type", "rope", "--world-size", "1", "--gpu", "H100-80GB", "--gpu-memory", "2GiB",
        "--max-seq-length",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("longest sequence")]
    assert len(lines) == 2 and all("tokens fit (lengths in steps of 512" in line for line in lines)


@pytest.mark.slow
def test_the_guide_shows_what_its_commands_print(capsys):
    """docs/scale.md's Llama-3-8B-shaped example: each quoted line is printed by its commands."""
    with open("docs/scale.md", encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("## The longest sequence that fits")
    section = text[start : text.index("\n## ", start)]  # to the next section
    shape = section.split('L3="', 1)[1].split('"', 1)[0].split()
    commands = [line.split()[2:] for line in section.splitlines() if line.startswith("p2r-plan $L3 ")]
    quoted = [line for line in section.splitlines() if line.startswith("longest sequence ")]
    assert len(commands) == 2 and len(quoted) == 2
    printed = set()
    for argv in commands:
        assert main(shape + argv) == 0
        printed.update(capsys.readouterr().out.splitlines())
    assert [line for line in quoted if line not in printed] == []


def test_training_flags_are_not_taken_for_abbreviated_planner_flags():
    """--seq-length is the training parser's, not an abbreviation of --seq-length-granularity."""
    args, rest = planner_parser().parse_known_args(["--world-size", "8", "--seq-length", "2048"])
    assert rest == ["--seq-length", "2048"] and args.seq_length_granularity == 512
