"""The ParallelPlan: the facts of a layout that several parts of the code need, computed once.

A pure object built from a ``Config`` and a ``Layout`` (no process groups, no tensors), so any
rank of a 512-GPU layout is planned in one process. It holds:

- each pipeline stage's model chunks (one; v with interleaving: chunk c of stage p is virtual
  stage c*P + p, and each is a stage of its own with its global layer range), the module key
  each layer calls (in the pseudo phase several layers call one key) and the modules the stage
  builds — one per key, however many of its chunks call it;
- the tensors held by several pipeline stages — the tied word embedding on the first and last
  stage, a pseudo-phase module called on several stages — and the stages holding them. These
  are pipeline ranks: a module two chunks of one rank call is one module there, which
  accumulates both gradients locally before the cross-stage reduction;
- each parameter's gradient reduction: over DP or expert-DP, fused with the sum over the
  stages that hold replicas of it (one all-reduce over "those stages x DP");
- which rank's copy of each logical element counts in the global gradient norm;
- the offload choice of each stage;
- the tensor table of each stage (``layout.tensors``).

The model, initialisation, process-group creation, gradient sync, checkpoints and the planner
read it; none of them derives these facts again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_p2r.config import Config, ModelConfig, stage_layer_counts
from megatron_p2r.layout import offload as offload_choice
from megatron_p2r.layout.ranks import Coords, Layout
from megatron_p2r.layout.sharing import effective_pattern, layer_module_keys, stages_using_slot
from megatron_p2r.layout.tensors import WORD_EMBEDDING, TensorSpec, stage_tensors


@dataclass(frozen=True)
class Reduction:
    """Where one parameter's gradient is reduced after backward.

    One all-reduce over ``over`` (``dp`` or ``expert_dp``) of the pipeline stages ``stages``
    (empty: this stage alone) sums the replicas of those stages and the data-parallel copies
    together; the result is divided by the DP size (expert gradients too: docs/moe.md).
    ``kind`` is the name logs and the planner use: dp, expert_dp, embedding or sharing.
    """

    kind: str
    over: str
    stages: Tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkPlan:
    """One virtual pipeline stage: model chunk ``chunk`` of its pipeline stage."""

    index: int                     # virtual stage: chunk * P + pipeline stage
    chunk: int
    layers: range                  # global layer indices
    layer_keys: Tuple[int, ...]    # the module key each of those layers calls
    first: bool                    # virtual stage 0: the embedding
    last: bool                     # the last virtual stage: final norm, output layer, loss


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (rank): its model chunks, the modules they call, what it offloads."""

    index: int
    chunks: Tuple[ChunkPlan, ...]
    offloaded: Tuple[int, ...] = ()   # module keys whose weights (or moments) live on host

    @property
    def layers(self) -> Tuple[int, ...]:
        """Global layer indices, chunk by chunk (the order ``layer_keys`` and the model use)."""
        return tuple(i for c in self.chunks for i in c.layers)

    @property
    def layer_keys(self) -> Tuple[int, ...]:
        return tuple(k for c in self.chunks for k in c.layer_keys)

    @property
    def first(self) -> bool:
        """Holds the embedding (chunk 0 of stage 0)."""
        return self.chunks[0].first

    @property
    def last(self) -> bool:
        """Holds the final norm, output layer and loss (the last chunk of stage P-1)."""
        return self.chunks[-1].last

    @property
    def modules(self) -> Tuple[int, ...]:
        """The distinct module keys, in order of first use (the order the stage builds them)."""
        return tuple(dict.fromkeys(self.layer_keys))


def stage_layer_ranges(num_layers: int, pp: int, split: Optional[str] = None, chunks: int = 1) -> List[range]:
    """Global layer indices of each virtual stage: of each pipeline stage (even, or
    ``--pipeline-layer-split``) when ``chunks`` is 1, else L / (P x chunks) layers each."""
    counts = stage_layer_counts(num_layers, pp, split) if chunks == 1 else [num_layers // (pp * chunks)] * (pp * chunks)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class ParallelPlan:
    layout: Layout
    model: ModelConfig
    phase: str
    share_pattern: str             # effective pattern: ``none`` in the real phase
    layer_keys: Tuple[int, ...]    # module key of every global layer
    stages: Tuple[StagePlan, ...]  # one per pipeline rank
    replicas: Tuple[Tuple[str, Tuple[int, ...]], ...]   # (logical name prefix, stages holding it)

    @classmethod
    def build(cls, cfg: Config, layout: Layout) -> "ParallelPlan":
        """The plan of ``cfg`` on ``layout`` (``cfg`` is assumed validated)."""
        m, p = cfg.model, cfg.parallel
        pattern = effective_pattern(cfg.p2r.p2r_phase, cfg.p2r.share_pattern)
        keys = tuple(layer_module_keys(pattern, m.num_layers, [m.is_moe_layer(i) for i in range(m.num_layers)]))
        pp = p.pipeline_model_parallel_size
        ranges = stage_layer_ranges(m.num_layers, pp, p.pipeline_layer_split, p.num_model_chunks(m.num_layers))
        chunks = [ChunkPlan(index=v, chunk=v // pp, layers=r, layer_keys=tuple(keys[i] for i in r), first=v == 0,
                            last=v == len(ranges) - 1) for v, r in enumerate(ranges)]
        stages = tuple(StagePlan(index=s, chunks=tuple(chunks[s::pp])) for s in range(pp))
        users = stages_using_slot(keys, [st.layers for st in stages])   # in pipeline ranks
        replicas = [(f"layers.{k}", tuple(st)) for k, st in users.items() if len(st) > 1]
        if not m.untie_embeddings_and_output_weights and pp > 1:
            replicas.append((WORD_EMBEDDING, (0, pp - 1)))
        plan = cls(layout=layout, model=m, phase=cfg.p2r.p2r_phase, share_pattern=pattern, layer_keys=keys,
                   stages=stages, replicas=tuple(replicas))
        if cfg.offload.cpu_offload_layers is None:
            return plan
        return dataclasses.replace(plan, stages=tuple(_with_offload(plan, st, cfg) for st in stages))

    @classmethod
    def for_world(cls, cfg: Config, world_size: int) -> "ParallelPlan":
        p = cfg.parallel
        return cls.build(cfg, Layout.from_world(world_size, p.tensor_model_parallel_size,
                                                p.pipeline_model_parallel_size, p.expert_model_parallel_size))

    @classmethod
    def model_parallel(cls, cfg: Config) -> "ParallelPlan":
        """The plan of ``cfg``'s TP/PP/EP with the least data parallelism (DP = EP): what a
        checkpoint's files and tensors depend on, whatever the run's DP size."""
        p = cfg.parallel
        ep = p.expert_model_parallel_size
        return cls.build(cfg, Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                                         dp=ep, ep=ep))

    # -- stages and tensors
    def stage(self, pp_rank: int) -> StagePlan:
        return self.stages[pp_rank]

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per pipeline rank (Megatron's virtual pipeline size; 1: no interleaving)."""
        return len(self.stages[0].chunks)

    @property
    def virtual_stages(self) -> Tuple[ChunkPlan, ...]:
        """Every virtual stage, in pipeline order (the stages themselves without interleaving)."""
        return tuple(sorted((c for st in self.stages for c in st.chunks), key=lambda c: c.index))

    def tensors(self, stage: int) -> List[TensorSpec]:
        """Every parameter a rank of ``stage`` holds (local shapes), in the model's order."""
        st = self.stages[stage]
        return stage_tensors(self.model, self.layout.tp, self.layout.ep, st.modules, st.first, st.last)

    def module_numel(self, stage: int) -> Dict[int, int]:
        """Parameters per module key of ``stage`` on one rank."""
        out = {k: 0 for k in self.stages[stage].modules}
        for s in self.tensors(stage):
            if s.name.startswith("layers."):
                out[int(s.name.split(".")[1])] += s.numel
        return out

    # -- replicas and reductions
    def replica_stages(self, logical: str) -> Tuple[int, ...]:
        """The pipeline stages holding a replica of tensor ``logical`` (empty: one stage)."""
        for prefix, stages in self.replicas:
            if logical == prefix or logical.startswith(prefix + "."):
                return stages
        return ()

    def reduction(self, logical: str, expert: bool) -> Reduction:
        over = "expert_dp" if expert else "dp"
        stages = self.replica_stages(logical)
        if not stages:
            return Reduction(kind=over, over=over)
        return Reduction(kind="embedding" if logical == WORD_EMBEDDING else "sharing", over=over, stages=stages)

    def stage_sets(self) -> Tuple[Tuple[int, ...], ...]:
        """The sets of stages that need a cross-stage reduction group (each also x DP / expert-DP)."""
        return tuple(sorted({stages for _, stages in self.replicas}))

    def counts_in_norm(self, logical: str, tp_dim, expert: bool, coords: Coords) -> bool:
        """Whether this rank's copy of a tensor counts in the global gradient norm.

        Each logical element counts exactly once: TP-replicated tensors on TP rank 0, stage
        replicas on their first stage, data-parallel replicas on DP (or expert-DP) rank 0.
        """
        if tp_dim is None and coords.tp != 0:
            return False
        stages = self.replica_stages(logical)
        if stages and coords.pp != min(stages):
            return False
        return (coords.expert_dp if expert else coords.dp) == 0

    def slot_users(self) -> Dict[int, Tuple[int, ...]]:
        """module key -> the global layers that call it."""
        out: Dict[int, List[int]] = {}
        for layer, key in enumerate(self.layer_keys):
            out.setdefault(key, []).append(layer)
        return {k: tuple(v) for k, v in out.items()}


def _with_offload(plan: ParallelPlan, st: StagePlan, cfg: Config) -> StagePlan:
    numel = plan.module_numel(st.index)
    total = offload_choice.state_bytes(sum(s.numel for s in plan.tensors(st.index)))
    per_module = {k: offload_choice.state_bytes(n) for k, n in numel.items()}
    chosen = offload_choice.choose_offloaded(cfg.offload, cfg.model.num_layers, st.layer_keys, st.layers, total,
                                             per_module, f"stage {st.index}")
    return dataclasses.replace(st, offloaded=tuple(chosen))
