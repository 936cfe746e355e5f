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
- each parameter's gradient reduction: over its data-parallel replicas (DP x CP ranks: every
  context-parallel rank holds the whole model) or expert-DP, fused with the sum over the
  stages that hold replicas of it (one all-reduce over "those stages x DP"), and with the sum
  over the TP ranks whose copies hold partial gradients (grouped-query attention's replicated
  key/value heads, --qk-layernorm weights, and under sequence parallelism the parameters
  applied to sequence shards: norms, biases added after a reduce-scatter, the MoE router, the
  position embedding): "TP block x stages x DP";
- which rank's copy of each logical element counts in the global gradient norm;
- each stage's gradient buffers and buckets, and under the distributed optimizer the owner of
  every range of every parameter (``layout.buckets``);
- the offload choice of each stage;
- the tensor specs of each stage (``layout.tensor_specs``).

The model, initialisation, process-group creation, gradient sync, checkpoints and the planner
read it; none of them derives these facts again.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_p2r.config import Config, ModelConfig, stage_layer_counts
from megatron_p2r.config.schedule import SchedulePlan, schedule_plan
from megatron_p2r.layout import offload as offload_choice
from megatron_p2r.layout.buckets import GradBuffer, default_bucket_size, layout_buffer
from megatron_p2r.layout.ranks import Coords, Layout
from megatron_p2r.layout.sharing import effective_pattern, layer_module_keys, stages_using_slot
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING, TensorSpec, stage_tensors


@dataclass(frozen=True)
class Reduction:
    """Where one parameter's gradient is reduced after backward.

    One all-reduce over ``over`` (``dp`` or ``expert_dp``) of the pipeline stages ``stages``
    (empty: this stage alone) and of the ``tp_block`` consecutive TP ranks holding this rank's
    copy (1: this TP rank alone) sums the replicas of those stages, the partial gradients of
    those TP ranks and the data-parallel copies together; the result is divided by the DP size
    (expert gradients too: docs/moe.md). ``kind`` is the name logs and the planner use: dp,
    expert_dp, embedding, sharing, or tp_partial (summed over TP ranks, on one stage).
    """

    kind: str
    over: str
    stages: Tuple[int, ...] = ()
    tp_block: int = 1


@dataclass(frozen=True)
class ChunkPlan:
    """One virtual pipeline stage: model chunk ``chunk`` of its pipeline stage."""

    index: int  # virtual stage: chunk * P + pipeline stage
    chunk: int
    layers: range  # global layer indices
    layer_keys: Tuple[int, ...]  # the module key each of those layers calls
    first: bool  # virtual stage 0: the embedding
    last: bool  # the last virtual stage: final norm, output layer, loss


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (rank): its model chunks, the modules they call, what it offloads."""

    index: int
    chunks: Tuple[ChunkPlan, ...]
    offloaded: Tuple[int, ...] = ()  # module keys whose weights (or moments) live on host

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

    def final_chunk(self, name: str, module_key: Optional[int]) -> int:
        """The model chunk in whose backward parameter ``name`` (of layer module ``module_key``,
        None outside the layers) receives its last gradient contribution: backward runs the chunks
        in reverse, so that is the lowest chunk that uses the module (the embedding is chunk 0's,
        the final norm and output layer the last chunk's)."""
        if module_key is not None:
            return min(part.chunk for part in self.chunks if module_key in part.layer_keys)
        return 0 if name.startswith("embedding.") else len(self.chunks) - 1


@dataclass(frozen=True)
class BufferSettings:
    """What shapes the gradient buffers and the state a rank holds: Megatron's bucket size rule,
    whether the distributed optimizer shards them, whether buckets break at layer modules
    (offload configured), the weights' dtype (16-bit with --bf16/--fp16), the
    optimizer and the bytes of an element's moments (AdamW: ``--exp-avg-dtype`` +
    ``--exp-avg-sq-dtype``; Lion: ``--exp-avg-dtype``; Adafactor: none, its statistics are per
    matrix); the dtypes of the gradient buffers and of the main parameters (``--main-grads-dtype``,
    ``--main-params-dtype``)."""

    bucket_size: Optional[int] = None
    distributed: bool = False
    break_at_modules: bool = False
    params_dtype: str = "fp32"  # the weights': fp32, bf16 (--bf16) or fp16 (--fp16)
    moment_bytes: int = offload_choice.ADAM_BYTES
    optimizer: str = "adam"
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"

    @property
    def param_bytes(self) -> int:
        return offload_choice.DTYPE_BYTES[self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        return offload_choice.DTYPE_BYTES[self.main_grads_dtype]

    @property
    def main_bytes(self) -> int:
        """Bytes of a main parameter element (the one the optimizer steps)."""
        return offload_choice.DTYPE_BYTES[self.main_params_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes of a main copy per stepped element: none where the weights are their own mains
        (fp32 weights; --fp16 weights with --main-params-dtype fp16)."""
        return 0 if self.params_dtype == self.main_params_dtype else self.main_bytes


def _moment_bytes(cfg: Config) -> int:
    """Bytes of the moments ``--optimizer`` keeps per stepped element."""
    return sum(offload_choice.DTYPE_BYTES[d] for d in cfg.train.moment_dtypes)


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
    share_pattern: str  # effective pattern: ``none`` in the real phase
    layer_keys: Tuple[int, ...]  # module key of every global layer
    stages: Tuple[StagePlan, ...]  # one per pipeline rank
    replicas: Tuple[Tuple[str, Tuple[int, ...]], ...]  # (logical name prefix, stages holding it)
    schedule: SchedulePlan  # the pipeline schedule of a training step (config/schedule.py)
    buffers: BufferSettings = BufferSettings()
    tp_blocks: Tuple[Tuple[str, int], ...] = ()  # (logical name, TP ranks summing its partial gradients)
    sequence_parallel: bool = False  # --sequence-parallel with TP > 1
    cp_comm_type: str = "p2p"  # how attention talks across the CP ranks (layout.cp > 1)

    @classmethod
    def build(cls, cfg: Config, layout: Layout) -> "ParallelPlan":
        """The plan of ``cfg`` on ``layout`` (``cfg`` is assumed validated)."""
        m, p = cfg.model, cfg.parallel
        pattern = effective_pattern(cfg.p2r.p2r_phase, cfg.p2r.share_pattern)
        keys = tuple(layer_module_keys(pattern, m.num_layers, [m.is_moe_layer(i) for i in range(m.num_layers)]))
        pp = p.pipeline_model_parallel_size
        ranges = stage_layer_ranges(m.num_layers, pp, p.pipeline_layer_split, p.num_model_chunks(m.num_layers))
        chunks = [
            ChunkPlan(
                index=v,
                chunk=v // pp,
                layers=r,
                layer_keys=tuple(keys[i] for i in r),
                first=v == 0,
                last=v == len(ranges) - 1,
            )
            for v, r in enumerate(ranges)
        ]
        stages = tuple(StagePlan(index=s, chunks=tuple(chunks[s::pp])) for s in range(pp))
        users = stages_using_slot(keys, [st.layers for st in stages])  # in pipeline ranks
        replicas = [(f"layers.{k}", tuple(st)) for k, st in users.items() if len(st) > 1]
        if pp > 1 and (not m.untie_embeddings_and_output_weights or m.mtp_num_layers):
            replicas.append((WORD_EMBEDDING, (0, pp - 1)))  # tied output layer, or the MTP lookups' replica
        buffers = BufferSettings(
            bucket_size=default_bucket_size(layout.dp_cp, p.overlap_grad_reduce, p.ddp_bucket_size),
            distributed=p.use_distributed_optimizer,
            break_at_modules=cfg.offload.cpu_offload_layers is not None,
            params_dtype="bf16" if cfg.train.bf16 else "fp16" if cfg.train.fp16 else "fp32",
            moment_bytes=_moment_bytes(cfg),
            optimizer=cfg.train.optimizer,
            main_grads_dtype=cfg.train.main_grads_dtype,
            main_params_dtype=cfg.train.main_params_dtype,
        )
        plan = cls(
            layout=layout,
            model=m,
            phase=cfg.p2r.p2r_phase,
            share_pattern=pattern,
            layer_keys=keys,
            stages=stages,
            replicas=tuple(replicas),
            schedule=schedule_plan(cfg),
            buffers=buffers,
            sequence_parallel=p.sequence_parallel and layout.tp > 1,
            cp_comm_type=p.cp_comm_type,
        )
        plan = dataclasses.replace(plan, tp_blocks=_tp_blocks(plan))
        if cfg.offload.cpu_offload_layers is None:
            return plan
        return dataclasses.replace(plan, stages=tuple(_with_offload(plan, st, cfg) for st in stages))

    @classmethod
    def for_world(cls, cfg: Config, world_size: int) -> "ParallelPlan":
        p = cfg.parallel
        return cls.build(
            cfg,
            Layout.from_world(
                world_size,
                p.tensor_model_parallel_size,
                p.pipeline_model_parallel_size,
                p.expert_model_parallel_size,
                p.context_parallel_size,
            ),
        )

    @classmethod
    def model_parallel(cls, cfg: Config) -> "ParallelPlan":
        """The plan of ``cfg``'s TP/PP/EP with the least data parallelism (DP = EP): what a
        checkpoint's files and tensors depend on, whatever the run's DP size."""
        p = cfg.parallel
        ep = p.expert_model_parallel_size
        return cls.build(cfg, Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=ep, ep=ep))

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
        return stage_tensors(
            self.model, self.layout.tp, self.layout.ep, st.modules, st.first, st.last, self.sequence_parallel
        )

    def module_numel(self, stage: int) -> Dict[int, int]:
        """Parameters per module key of ``stage`` on one rank."""
        out = {k: 0 for k in self.stages[stage].modules}
        for s in self.tensors(stage):
            if s.module_key is not None:
                out[s.module_key] += s.numel
        return out

    # -- replicas and reductions
    def replica_stages(self, logical: str) -> Tuple[int, ...]:
        """The pipeline stages holding a replica of tensor ``logical`` (empty: one stage)."""
        for prefix, stages in self.replicas:
            if logical == prefix or logical.startswith(prefix + "."):
                return stages
        return ()

    @functools.cached_property
    def _tp_block_of(self) -> Dict[str, int]:
        return dict(self.tp_blocks)

    def tp_block(self, logical: str) -> int:
        """Consecutive TP ranks whose copies of ``logical`` hold partial gradients (1: none)."""
        return self._tp_block_of.get(logical, 1)

    def reduction(self, logical: str, expert: bool) -> Reduction:
        over = "expert_dp" if expert else "dp"
        stages, block = self.replica_stages(logical), self.tp_block(logical)
        if stages:
            kind = "embedding" if logical == WORD_EMBEDDING else "sharing"
        else:
            kind = "tp_partial" if block > 1 else over
        return Reduction(kind=kind, over=over, stages=stages, tp_block=block)

    def stage_sets(self) -> Tuple[Tuple[int, ...], ...]:
        """The sets of stages that need a cross-stage reduction group (each also x DP / expert-DP)."""
        return tuple(sorted({stages for _, stages in self.replicas}))

    def tp_block_sets(self) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
        """(stages, TP block) of every reduction summing over TP ranks: each needs groups
        "TP block x those stages (empty: each stage alone) x DP / expert-DP"."""
        return tuple(sorted({(self.replica_stages(name), block) for name, block in self.tp_blocks}))

    def counts_in_norm(self, logical: str, tp_dim, expert: bool, coords: Coords, sharded: bool = False) -> bool:
        """Whether this rank's copy of a tensor (its shard, when ``sharded``) counts in the global
        gradient norm.

        Each logical element counts exactly once: TP-replicated tensors on TP rank 0, stage
        replicas on their first stage, data-parallel replicas on DP (or expert-DP) rank 0; a
        distributed-optimizer shard is owned by one member of its reduction group already.
        """
        if sharded:  # one member of the reduction group (TP block x stages x DP) owns each element
            return tp_dim is not None or coords.tp == 0 or self.tp_block(logical) > 1
        if (tp_dim is None and coords.tp != 0) or coords.tp % self.tp_block(logical):
            return False
        stages = self.replica_stages(logical)
        if stages and coords.pp != min(stages):
            return False
        return (coords.expert_dp if expert else coords.dp_cp) == 0

    # -- gradient buffers and optimizer shards
    def group_members(self, over: str, stages: Tuple[int, ...], tp_block: int = 1) -> int:
        """Ranks in the reduction group "TP block x stages x over" (one stage when ``stages`` is empty)."""
        size = self.layout.expert_dp if over == "expert_dp" else self.layout.dp_cp
        return size * max(len(stages), 1) * tp_block

    def grad_buffers(self, stage: int) -> Tuple[GradBuffer, ...]:
        """The gradient buffers of a rank of ``stage``: one per reduction group, parameters in
        reverse order — for a cross-stage group in the reverse order of its first stage, so
        every member lays the group out identically (its collectives line up element by element)."""
        specs = self.tensors(stage)
        groups: Dict[Tuple[str, Tuple[int, ...], int], list] = {}
        for s in specs:
            red = self.reduction(s.logical, s.expert)
            groups.setdefault((red.over, red.stages, red.tp_block), []).append(s)
        out = []
        for (over, stages, block), members in sorted(groups.items()):
            reference = [s.logical for s in self.tensors(min(stages))] if stages else [s.logical for s in specs]
            ordered = sorted(members, key=lambda s: reference.index(s.logical), reverse=True)
            size = self.group_members(over, stages, block)
            out.append(
                layout_buffer(
                    over,
                    stages,
                    block,
                    size,
                    self.buffers.distributed and size > 1,
                    [s.name for s in ordered],
                    [s.numel for s in ordered],
                    [s.module_key for s in ordered],
                    self.buffers.bucket_size,
                    self.buffers.break_at_modules,
                )
            )
        return tuple(out)

    def buffer_member(self, buffer: GradBuffer, coords: Coords) -> int:
        """This rank's index in ``buffer``'s reduction group (its process-group rank: ranks in order)."""
        expert = buffer.over == "expert_dp"
        index, size = (coords.expert_dp, self.layout.expert_dp) if expert else (coords.dp_cp, self.layout.dp_cp)
        stage = sorted(buffer.stages).index(coords.pp) if buffer.stages else 0
        return (stage * size + index) * buffer.tp_block + coords.tp % buffer.tp_block

    def optimizer_shards(self, stage: int, name: str) -> List[Tuple[int, int, int]]:
        """Under the distributed optimizer, who steps which part of parameter ``name`` of ``stage``:
        (member of its reduction group, start, end) in the parameter's flat coordinates."""
        for buf in self.grad_buffers(stage):
            if name in buf.names:
                return buf.param_shards(buf.names.index(name))
        raise KeyError(f"stage {stage} holds no parameter {name!r}")

    def module_state_bytes(self, stage: int, coords: Optional[Coords] = None) -> Dict[Optional[int], Dict[str, int]]:
        """Bytes of weights, gradient buffers and optimizer state a rank of ``stage`` holds, per
        layer module (key K; None for the embedding, final norm and output layer): exact, the
        buffers' padding included; ``coords`` picks the rank (default: the first of each group,
        which owns the most under the distributed optimizer)."""
        out: Dict[Optional[int], Dict[str, int]] = {}
        shapes = {s.name: s.shape for s in self.tensors(stage)}
        for buf in self.grad_buffers(stage):
            member = 0 if coords is None else self.buffer_member(buf, coords)
            owned = {i: end - start for i, start, end in buf.owned(member)}
            for i, footprint in enumerate(buf.footprints()):
                b = self.buffers
                add = offload_choice.state_bytes(
                    footprint,
                    b.param_bytes,
                    owned.get(i, 0),
                    b.moment_bytes,
                    shapes[buf.names[i]],
                    b.optimizer,
                    b.grad_bytes,
                    b.master_bytes,
                )
                out[buf.modules[i]] = offload_choice.add_bytes(out.get(buf.modules[i], {}), add)
        return out


def _tp_blocks(plan: ParallelPlan) -> Tuple[Tuple[str, int], ...]:
    """(logical name, TP block) of every tensor whose TP copies hold partial gradients."""
    tp = plan.layout.tp
    blocks = {s.logical: s.tp_sum_block(tp) for stage in range(len(plan.stages)) for s in plan.tensors(stage)}
    return tuple((name, block) for name, block in blocks.items() if block > 1)


def _with_offload(plan: ParallelPlan, st: StagePlan, cfg: Config) -> StagePlan:
    per_module = plan.module_state_bytes(st.index)
    total: Dict[str, int] = {}
    for part in per_module.values():
        total = offload_choice.add_bytes(total, part)
    per_module.pop(None, None)
    chosen = offload_choice.choose_offloaded(
        cfg.offload, cfg.model.num_layers, st.layer_keys, st.layers, total, per_module, f"stage {st.index}"
    )
    return dataclasses.replace(st, offloaded=tuple(chosen))
