"""Which pipeline schedule a run's stages follow, decided once from the config.

The runtime (``pipeline.schedules.get_forward_backward_func``), the planner's activation walk
(``planning.activations.stage_schedule``) and the validation all read ``schedule_plan``; none works the choice out
again, and every refusal of a schedule combination is raised here.

| stages | --pipeline-schedule | model chunks | --overlap-moe-expert-parallel-comm | schedule |
|---|---|---|---|---|
| 1 | any (no effect, as in Megatron-LM) | 1 | off | no pipelining |
| 1 | any | 1 | on | combined 1F1B on one stage |
| > 1 | gpipe | 1 | off | GPipe |
| > 1 | 1f1b | 1 | off | 1F1B |
| > 1 | 1f1b | > 1 | off | interleaved 1F1B (receives posted ahead with --overlap-p2p-communication) |
| > 1 | 1f1b | any | on | combined 1F1B (receives never posted ahead) |
| > 1 | gpipe | > 1 | any | refused: interleaving is a 1F1B schedule |
| > 1 | gpipe | 1 | on | refused: the overlap runs the combined 1F1B schedule |
| > 1 | 1f1b | > 1 | on, with --overlap-p2p-communication | refused: the combined schedule posts nothing ahead |
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.root import Config

NO_PIPELINING, GPIPE, ONE_F_ONE_B, INTERLEAVED, COMBINED = (
    "no-pipelining",
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "combined-1f1b",
)
OVERLAP_MOE = "--overlap-moe-expert-parallel-comm"


@dataclass(frozen=True)
class SchedulePlan:
    """The schedule of a training step (``kind``) over ``stages`` pipeline ranks of ``chunks``
    model chunks each; ``posts_receives_ahead``: each op's receives are posted while the op
    before it computes (--overlap-p2p-communication under interleaving)."""

    kind: str
    stages: int
    chunks: int
    posts_receives_ahead: bool = False

    @property
    def serial(self) -> "SchedulePlan":
        """The schedule without the expert all-to-all overlap (the combined schedule pairs each
        forward with a backward): what an evaluation's forward-only steps run."""
        if self.kind != COMBINED:
            return self
        if self.stages == 1:
            return SchedulePlan(NO_PIPELINING, 1, 1)
        return SchedulePlan(INTERLEAVED if self.chunks > 1 else ONE_F_ONE_B, self.stages, self.chunks)

    @property
    def order(self) -> str:
        """The name ``pipeline.order`` builds the op order from ("gpipe" or "1f1b")."""
        return "gpipe" if self.kind == GPIPE else "1f1b"


def choose_schedule(stages: int, schedule: str, chunks: int, overlap_p2p: bool, overlap_moe: bool) -> SchedulePlan:
    """The table above: ``schedule`` is --pipeline-schedule, ``overlap_p2p`` and ``overlap_moe``
    the two overlap flags."""
    if schedule not in (GPIPE, ONE_F_ONE_B):
        raise ConfigError(f"--pipeline-schedule {schedule!r}: expected 1f1b or gpipe")
    if stages == 1:
        return SchedulePlan(COMBINED if overlap_moe else NO_PIPELINING, 1, 1)
    if chunks > 1 and schedule == GPIPE:
        raise ConfigError(
            f"interleaving is a 1F1B schedule ({chunks} model chunks per pipeline rank); --pipeline-schedule is 'gpipe'"
        )
    if overlap_moe:
        if schedule == GPIPE:
            raise ConfigError(
                f"{OVERLAP_MOE} with --pipeline-model-parallel-size > 1 runs the combined 1F1B "
                "schedule: it needs --pipeline-schedule 1f1b (have gpipe)"
            )
        if chunks > 1 and overlap_p2p:
            raise ConfigError(
                f"{OVERLAP_MOE} with interleaving runs the combined 1F1B schedule, which does not post "
                "its p2p receives ahead: pass --no-overlap-p2p-communication"
            )
        return SchedulePlan(COMBINED, stages, chunks)
    if schedule == GPIPE:
        return SchedulePlan(GPIPE, stages, 1)
    if chunks > 1:
        return SchedulePlan(INTERLEAVED, stages, chunks, posts_receives_ahead=overlap_p2p)
    return SchedulePlan(ONE_F_ONE_B, stages, 1)


def schedule_plan(cfg: Config) -> SchedulePlan:
    """The schedule of ``cfg``'s training steps; refuses what the overlapped schedules cannot run."""
    p, m = cfg.parallel, cfg.model
    overlap_moe = p.overlap_moe_expert_parallel_comm
    if overlap_moe:
        _check_overlap_moe(cfg)
    return choose_schedule(
        p.pipeline_model_parallel_size,
        p.pipeline_schedule,
        p.num_model_chunks(m.num_layers),
        p.overlap_p2p_communication,
        overlap_moe,
    )


def _check_overlap_moe(cfg: Config) -> None:
    """--overlap-moe-expert-parallel-comm: Megatron-LM's rule (EP > 1), and what the overlapped
    schedules need: layers run eagerly, and full recomputation one layer at a time. Megatron-LM
    refuses full recomputation, whose unit of layers cannot be cut at its all-to-alls; here a
    recomputed layer is recomputed node by node, keeping the all-to-alls' results (nothing is
    re-communicated), which a unit of one layer allows."""
    p, t = cfg.parallel, cfg.train
    if p.expert_model_parallel_size == 1 or not cfg.model.num_experts:
        raise ConfigError(
            f"{OVERLAP_MOE} overlaps the expert all-to-alls: it needs --num-experts and "
            f"--expert-model-parallel-size > 1 (as in Megatron-LM; have {p.expert_model_parallel_size})"
        )
    if t.recompute == "full" and t.recompute_method == "uniform" and t.recompute_num_layers > 1:
        raise ConfigError(
            f"{OVERLAP_MOE} recomputes one layer at a time, cut at its all-to-alls: with "
            "--recompute-granularity full it needs --recompute-method uniform --recompute-num-layers 1 "
            f"or --recompute-method block (have uniform, --recompute-num-layers {t.recompute_num_layers})"
        )
    if t.compile:
        raise ConfigError(
            f"{OVERLAP_MOE} conflicts with --compile: the overlapped schedule runs each MoE layer in "
            "pieces, outside the layer's compiled forward"
        )
