"""The longest sequence a layout trains at: ``p2r-plan --max-seq-length``.

A plan's memory grows with the sequence (activations, the attention core's buffers, the
logits), so the planner's own verdict, asked at growing lengths, finds the longest that fits:
doubling from one step until a length does not fit, then halving the gap. Every length asked
is a whole number of ``step`` tokens, the multiple the layout needs (sequence parallelism
splits the sequence over TP) rounded up to ``granularity``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Tuple

from megatron_p2r.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class LongestSequence:
    """``tokens``: the longest length that fits (None: not even one ``step``); ``limit``: why the
    next length does not (the planner's problem, or the configuration's refusal); ``tried``: the
    lengths asked, in order, with their verdicts."""

    tokens: Optional[int]
    step: int
    limit: str
    tried: Tuple[Tuple[int, bool], ...]


def sequence_step(cfg: Config, granularity: int) -> int:
    """The multiple every length is asked at: ``granularity`` and what the layout requires (TP
    under sequence parallelism; 2 x CP equal chunks, Megatron-LM's rule, under context parallelism)."""
    p = cfg.parallel
    required = p.tensor_model_parallel_size if p.sequence_parallel else 1
    if p.context_parallel_size > 1:
        required *= 2 * p.context_parallel_size
    return math.lcm(granularity, required)


def longest_sequence(
    verdict: Callable[[int], Tuple[bool, str]], step: int, limit_tokens: int = 2**24
) -> LongestSequence:
    """The longest multiple of ``step`` up to ``limit_tokens`` for which ``verdict(tokens)`` says
    it fits; ``verdict`` returns (fits, why not). Assumes memory does not shrink with length."""
    tried: List[Tuple[int, bool]] = []
    reasons = {}

    def fits(units: int) -> bool:
        ok, why = verdict(units * step)
        tried.append((units * step, ok))
        reasons[units] = why
        return ok

    top = limit_tokens // step
    if top < 1 or not fits(1):
        return LongestSequence(None, step, reasons.get(1, f"--max-seq-length limit {limit_tokens}"), tuple(tried))
    good, bad = 1, None
    while bad is None:  # doubling: good fits, bad (once found) does not
        nxt = min(good * 2, top)
        if nxt == good:
            return LongestSequence(good * step, step, f"the search's limit, {limit_tokens:,} tokens", tuple(tried))
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return LongestSequence(good * step, step, f"at {bad * step:,} tokens: {reasons[bad]}", tuple(tried))


def at_length(cfg: Config, tokens: int) -> Config:
    """``cfg`` at sequences of ``tokens``, its positions table (learned, or Megatron's rotary
    limit) grown to the length where it is shorter."""
    return cfg.replace(seq_length=tokens, max_position_embeddings=max(cfg.model.max_positions, tokens))


def plan_verdict(cfg: Config, make: Callable[[Config], object]) -> Callable[[int], Tuple[bool, str]]:
    """``longest_sequence``'s verdict from the planner: ``make(cfg at a length)`` returns a
    ``Plan``; a length the configuration refuses does not fit, with its error as the reason."""

    def verdict(tokens: int) -> Tuple[bool, str]:
        try:
            plan = make(at_length(cfg, tokens))
        except ConfigError as exc:
            return False, str(exc)
        return plan.fits, "; ".join(plan.problems) or "does not fit"

    return verdict
