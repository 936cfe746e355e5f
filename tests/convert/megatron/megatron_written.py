"""The Megatron-written fixtures (tests/fixtures/megatron) and our logits of an imported one."""

import os
from functools import lru_cache
from typing import Dict, Optional, Tuple

import torch

from megatron_p2r.arguments import config_from_values, load_yaml
from megatron_p2r.checkpoint.io import load_checkpoint

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "megatron"))
FIXTURES = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "logits.pt")))


@lru_cache(maxsize=None)
def fixture_logits(name: str) -> Tuple[str, torch.Tensor, torch.Tensor]:
    """(Megatron's --save directory, the tokens [b, s], Megatron's fp32 logits [b, s, padded vocab])."""
    saved = torch.load(os.path.join(ROOT, name, "logits.pt"), weights_only=True)
    return os.path.join(ROOT, name, "checkpoint"), saved["tokens"], saved["logits"]


def loaded(ckpt: str, batch: int, world: Optional[int], **flags):
    """Our train state from the imported checkpoint's model.yaml and ``flags``, loaded with --load
    alone, on one process or on this rank of ``world`` gloo ranks."""
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.parallel.state import ParallelState, initialize_plan
    from megatron_p2r.training import build_train_state

    values = load_yaml(os.path.join(ckpt, "model.yaml"))
    cfg = config_from_values(
        {**values, "mock_data": True, "micro_batch_size": batch, "global_batch_size": batch, "device": "cpu", **flags}
    )
    plan, ps = None, ParallelState.single()
    if world is not None:
        plan = ParallelPlan.for_world(cfg, world)
        ps = initialize_plan(plan, torch.device("cpu"))
    state = build_train_state(cfg, ps, plan)
    load_checkpoint(ckpt, state)
    return state


def continued_logits(ckpt: str, batch: torch.Tensor, tokens: torch.Tensor, **flags) -> torch.Tensor:
    """Logits on ``tokens`` after one training step of ours on ``batch`` [b, s + 1] from the imported
    checkpoint (one process)."""
    from megatron_p2r.training import train_step

    state = loaded(ckpt, batch.shape[0], None, **flags)
    train_step(
        state,
        [
            {
                "tokens": batch[:, :-1],
                "labels": batch[:, 1:],
                "loss_mask": torch.ones(batch[:, 1:].shape, dtype=torch.float32),
            }
        ],
    )
    with torch.no_grad():
        return state.model.eval()(tokens=tokens).float()


def our_logits(ckpt: str, tokens: torch.Tensor, world: Optional[int] = None) -> torch.Tensor:
    """Logits [b, s, our padded vocab] of our imported checkpoint on one process or on this rank
    of ``world`` gloo ranks (the vocabulary shards gathered)."""
    state = loaded(ckpt, tokens.shape[0], world)
    ps = state.ps
    with torch.no_grad():
        logits = state.model.eval()(tokens=tokens).float()
    if world is None or ps.tp_size == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(ps.tp_size)]
    torch.distributed.all_gather(shards, logits.contiguous(), group=ps.group("tp"))
    return torch.cat(shards, dim=-1)


def logits_error(ours: torch.Tensor, megatron: torch.Tensor) -> Tuple[float, float]:
    """(max |ours - Megatron's|, that over max |Megatron's|) on Megatron's padded vocabulary (ours
    may pad further with zero rows)."""
    diff = (ours[..., : megatron.shape[-1]] - megatron).abs().max().item()
    return diff, diff / megatron.abs().max().item()


def _tp2_errors(rank: int, world: int, runs: dict) -> dict:
    """(max abs, rel) per fixture on this rank: numbers, not tensors, cross the process boundary."""
    return {
        name: logits_error(our_logits(ckpt, fixture_logits(name)[1], world=world), fixture_logits(name)[2])
        for name, ckpt in runs.items()
    }


def imported_errors(root: str) -> Dict[Tuple[str, int], Tuple[float, float]]:
    """{(fixture, target TP): (max abs, rel)}: every fixture imported with the CLI into TP1 and TP2
    under ``root``; TP2 evaluated on 2 gloo ranks (one launch for all)."""
    from tests.harness import run_distributed
    from tools.convert_checkpoint import main

    out, runs = {}, {}
    for name in FIXTURES:
        for tp in (1, 2):
            dst = os.path.join(root, f"{name}_tp{tp}")
            if (
                main(
                    [
                        "import-megatron",
                        fixture_logits(name)[0],
                        dst,
                        "--target-tensor-parallel-size",
                        str(tp),
                        "--no-progress",
                    ]
                )
                != 0
            ):
                raise RuntimeError(f"import-megatron failed on {name} (target TP{tp})")
        out[(name, 1)] = logits_error(
            our_logits(os.path.join(root, f"{name}_tp1"), fixture_logits(name)[1]), fixture_logits(name)[2]
        )
        runs[name] = os.path.join(root, f"{name}_tp2")
    rank0 = run_distributed(_tp2_errors, 2, runs, timeout=300)[0]
    out.update({(name, 2): err for name, err in rank0.items()})
    return out


if __name__ == "__main__":
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            errors = imported_errors(tmp)
    print("| fixture | into | max abs | rel (max abs / max abs of Megatron's logits) |\n|---|---|---|---|")
    for (name, tp), (abs_err, rel_err) in sorted(errors.items()):
        print(f"| {name} | TP{tp} | {abs_err:.1e} | {rel_err:.1e} |")
