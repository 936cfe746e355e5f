"""Megatron-LM's legacy checkpoint layout (``--ckpt-format torch``), as global canonical tensors.

    iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

one ``torch.save`` per TP rank TT, pipeline stage PPP (present when PP > 1) and expert-parallel
rank EEE (present when EP > 1), as ``megatron/training/checkpointing.py: get_checkpoint_name``
names them. Each holds ``args``, ``checkpoint_version``, ``iteration`` and ``model``: the state
dict of that rank's modules, TP shards under local names -- layers numbered from 0 on every
stage, experts numbered from 0 on every EP rank. Under a virtual pipeline (interleaved 1F1B,
``args.virtual_pipeline_model_parallel_size`` V) it holds ``model0`` .. ``model{V-1}`` instead,
one per model chunk, each numbering its layers from 0: chunk c of pipeline rank p is virtual
stage ``c * PP + p``, and the virtual stages hold the layers in that order. A (virtual) stage's
first global layer is the number of layers the stages before it hold (so uneven splits read as
they were saved); expert ``l`` of EP
rank ``r`` is global expert ``r * E / EP + l``. Dense tensors are replicated on every EP rank
and TP-unsplit ones on every TP rank: the copy of EP rank 0 / TP rank 0 is read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron import distrib_optim, optim_lists
from megatron_p2r.convert.megatron.buffer_layout import Param, bucket_size
from megatron_p2r.convert.megatron.args import SavedArgs
from megatron_p2r.convert.megatron.names import (
    IGNORED,
    MTP_LAYER,
    expert_rest,
    join_tp_shards,
    layer_name,
    mtp_layer_name,
    split_any_layer,
    split_layer_key,
    split_local_expert,
    tp_dim,
)
from megatron_p2r.convert.megatron.unpickler import Kind, LazyTensor, TorchArchive

MODEL_FILE = "model_optim_rng.pt"
_GROUPED = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])")
RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")


def rank_dir(tp: int, pp: int, ep: int, layout: Tuple[int, int, int]) -> str:
    """Megatron's directory name of rank (tp, pp, ep) in a (TP, PP, EP) layout."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout[1] > 1 else "") + (f"_{ep:03d}" if layout[2] > 1 else "")


class LegacyCheckpoint:
    """The tensors of a legacy iteration directory: shapes from the pickles alone, data on ``read``."""

    format = "legacy (torch)"

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        # Adam's state by kind, name and TP rank like ``names``: the distributed optimizer's
        # (distrib_optim.pt), or the fp32 non-distributed optimizer's lists in model_optim_rng.pt
        self.optimizer: Dict[str, Dict[str, Dict[int, LazyTensor]]] = {kind: {} for kind in distrib_optim.STATES}
        self._steps: set = set()
        dirs = sorted(d for d in os.listdir(iter_dir) if RANK_DIR.fullmatch(d))
        first = self._archive(dirs[0])
        self.saved, self.saved_path = first.obj, first.path  # iteration, opt_param_scheduler, ...
        self.args = SavedArgs.of(first.obj.get("args"), first.path)
        self._check_header(first)
        a = self.args
        self.layout = (a.tp, a.pp, a.ep)
        expected = {
            (t, p, e): rank_dir(t, p, e, self.layout) for p in range(a.pp) for e in range(a.ep) for t in range(a.tp)
        }
        unexpected = sorted(set(dirs) - set(expected.values()))
        if unexpected:
            raise CheckpointError(
                f"{os.path.join(iter_dir, unexpected[0])}: not a rank of the saved layout "
                f"(args: TP={a.tp}, PP={a.pp}, EP={a.ep}, so {len(expected)} mp_rank directories)"
            )
        self.chunks = int(a.get("virtual_pipeline_model_parallel_size") or 1) if a.pp > 1 else 1
        self.optimizer_not_read = None  # why the optimizer state that is there is skipped
        self.glu = bool(a.get("swiglu") or a.get("quick_geglu"))
        self.local_experts = (a.get("num_experts") or 0) // a.ep
        self.names: Dict[str, Dict[int, LazyTensor]] = {}
        self.files: Dict[str, str] = {}
        archives = {rank: first if rank == (0, 0, 0) else self._archive(d) for rank, d in expected.items()}
        # each rank file's model chunks as (the state dict with experts as linear weights, the
        # state dict as saved, local key -> canonical name), for its optimizer state
        chunks: Dict[Tuple[int, int, int], list] = {rank: [] for rank in archives}
        offset = 0
        for virtual in range(a.pp * self.chunks):  # in the order of the layers
            c, p = divmod(virtual, a.pp)
            counts = {
                self._add(archives[(t, p, e)], c, t, e, offset, chunks[(t, p, e)])
                for e in range(a.ep)
                for t in range(a.tp)
            }
            if len(counts) != 1:
                stage = f"stage {p}" + (f" model{c}" if self.chunks > 1 else "")
                raise CheckpointError(f"{iter_dir}: the files of {stage} hold different numbers of layers {counts}")
            offset += counts.pop()
        for (t, p, e), rank_chunks in chunks.items():
            if self.optimizer_not_read is None:
                self._add_optimizer_state(archives[(t, p, e)], rank_chunks, t, p)
        if offset != a.required("num_layers"):
            raise CheckpointError(
                f"{iter_dir}: the stages hold {offset} layers, args.num_layers is {a.values['num_layers']}"
            )
        if len(self._steps) > 1:
            raise CheckpointError(f"{iter_dir}: the rank files' optimizer states give Adam steps {sorted(self._steps)}")
        self.adam_step = self._steps.pop() if self._steps and self.optimizer["exp_avg"] else None

    def _archive(self, directory: str) -> TorchArchive:
        path = os.path.join(self.iter_dir, directory, MODEL_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"missing file {path} (each mp_rank directory holds a {MODEL_FILE})")
        archive = TorchArchive(path, Kind.MEGATRON)
        if not isinstance(archive.obj, dict):
            raise CheckpointError(
                f"{path}: holds a {type(archive.obj).__name__}, expected Megatron's saved dict "
                "(args, checkpoint_version, model, ...)"
            )
        return archive

    def _check_header(self, first: TorchArchive) -> None:
        version = first.obj.get("checkpoint_version", 0)
        if not isinstance(version, (int, float)) or version < 3.0:
            raise CheckpointError(
                f"{first.path}: checkpoint_version {version!r}; Megatron-LM checkpoints before "
                "version 3.0 order QKV differently and are not read"
            )
        experts, etp = self.args.get("num_experts"), self.args.get("expert_tensor_parallel_size")
        if experts and etp not in (None, self.args.tp):
            raise CheckpointError(
                f"{first.path}: args.expert_tensor_parallel_size {etp} differs from "
                f"args.tensor_model_parallel_size {self.args.tp}; the legacy layout of such "
                "experts is not read (save with --ckpt-format torch_dist)"
            )

    def _model(self, archive: TorchArchive, chunk: int) -> dict:
        """The state dict of model chunk ``chunk`` of a rank file (``model``, or ``model{chunk}``
        under a virtual pipeline)."""
        key = f"model{chunk}" if self.chunks > 1 else "model"
        if key not in archive.obj:
            keys = sorted(k for k in archive.obj if isinstance(k, str))
            saved = (
                f"args.virtual_pipeline_model_parallel_size is {self.chunks}, so model0..model{self.chunks - 1}"
                if self.chunks > 1
                else "args.virtual_pipeline_model_parallel_size is not set, so 'model'"
            )
            raise CheckpointError(f"{archive.path}: no {key!r} in the saved dict (keys {keys}; {saved})")
        model = archive.obj[key]
        if not isinstance(model, dict):
            raise CheckpointError(f"{archive.path}: {key!r} is {type(model).__name__}, expected a state dict")
        return model

    def _add(self, archive: TorchArchive, chunk: int, t: int, e: int, offset: int, chunks: list) -> int:
        """Record the tensors of one model chunk of a rank file, and the chunk in ``chunks``;
        returns how many layers it holds."""
        model = self._model(archive, chunk)
        grouped = _grouped_experts(model, self.local_experts, archive.path)
        layers, canonical = set(), {}
        for key, value in (grouped or model).items():
            if IGNORED.search(key):
                continue
            if not isinstance(value, LazyTensor):
                raise CheckpointError(f"{archive.path}: model[{key!r}] is {type(value).__name__}, expected a tensor")
            name = canonical[key] = self._canonical(key, e, offset, layers, archive.path)
            if name is None:
                continue
            if t in self.names.setdefault(name, {}):
                raise CheckpointError(f"{archive.path}: {key!r} names the same tensor as another entry ({name})")
            self.names[name][t] = value
            self.files.setdefault(name, archive.path)
        if layers != set(range(len(layers))):
            raise CheckpointError(f"{archive.path}: local layers {sorted(layers)} are not numbered 0..n-1")
        chunks.append((grouped or model, model, canonical))
        return len(layers)

    def _add_optimizer_state(self, archive: TorchArchive, chunks: list, t: int, stage: int) -> None:
        """Each tensor's optimizer state from the rank file's model chunks ``chunks`` (see
        ``__init__``): views of distrib_optim.pt beside ``archive``, or of its state lists."""
        path = os.path.join(os.path.dirname(archive.path), distrib_optim.FILE)
        saved = archive.obj.get("optimizer")
        if os.path.isfile(path):
            views = self._distrib_optim_views(archive, path, chunks, stage)
        elif self.args.get("use_distributed_optimizer"):  # its parameter state is distrib_optim.pt alone
            if saved is not None:
                self.optimizer_not_read = (
                    f"{archive.path}: the distributed optimizer's {distrib_optim.FILE} is not beside it"
                )
            return
        elif saved is not None and (self.chunks > 1 or any(model is not raw for model, raw, _ in chunks)):
            self.optimizer_not_read = (
                f"{archive.path}: the non-distributed optimizer's state lists of "
                + (
                    "virtual pipeline model chunks"
                    if self.chunks > 1
                    else "GroupedMLP experts (mlp.experts.weight1, weight2)"
                )
                + " are not read yet"
            )
            return
        else:
            ((model, _, canonical),) = chunks
            # experts are a parameter group of their own under expert parallelism only (allreduce False)
            expert_parallel = self.layout[2] > 1
            found = optim_lists.state_views(
                saved,
                [(key, tuple(model[key].shape), _is_expert(key) and expert_parallel) for key in canonical],
                archive.path,
            )
            if found is None:
                if saved is not None:
                    self.optimizer_not_read = optim_lists.not_read(saved, archive.path)
                return
            views, step = found
            self._steps.add(step)
            views = [views]
        for chunk_views, (_, _, canonical) in zip(views, chunks, strict=True):
            for kind, by_key in chunk_views.items():
                for key, view in by_key.items():
                    if canonical.get(key) is not None:
                        self.optimizer[kind].setdefault(canonical[key], {})[t] = view

    def _distrib_optim_views(self, archive: TorchArchive, path: str, chunks: list, stage: int) -> list:
        """kind -> local key -> its state, per model chunk, from ``distrib_optim.pt`` (one grad
        buffer per chunk, the parameters as the chunk's state dict holds them: GroupedMLP's
        ``weight1``/``weight2`` whole, their experts' blocks viewed after). Under EP > 1 the file is
        a list of two chained optimizers' states, the dense parameters' (in the file of the dense
        optimizer's DP rank 0, EP rank 0; None in the others) and the experts'."""
        state = TorchArchive(path, Kind.MEGATRON).obj
        tied = not self.args.get("untie_embeddings_and_output_weights") and self.layout[1] > 1
        expert_parallel = self.layout[2] > 1
        optimizers = [(state, lambda key: True)]
        if expert_parallel:
            if not isinstance(state, list) or len(state) != 2:
                raise CheckpointError(
                    f"{path}: holds {type(state).__name__}, expected a list of the states of "
                    "megatron-core's two chained optimizers (dense, experts) of an MoE model under "
                    f"expert parallelism (args.expert_model_parallel_size {self.layout[2]})"
                )
            optimizers = [(state[0], lambda key: not _is_expert(key)), (state[1], _is_expert)]
        views: list = [{kind: {} for kind in distrib_optim.STATES} for _ in chunks]
        for saved, mine in optimizers:
            if saved is None:  # kept by another rank's file
                continue
            buffers = [
                (
                    [
                        Param(
                            key,
                            tuple(raw[key].shape),
                            expert_parallel and _is_expert(key),
                            tied and key in ("embedding.word_embeddings.weight", "output_layer.weight"),
                        )
                        for key in raw
                        if not IGNORED.search(key) and mine(key)
                    ],
                    bucket_size(self.args, stage) if c == 0 else None,
                )
                for c, (_, raw, _) in enumerate(chunks)
            ]
            for chunk_views, found in zip(views, distrib_optim.state_views(saved, buffers, path), strict=True):
                for kind, by_key in found.items():
                    chunk_views[kind].update(by_key)
        self._steps.add(_adam_step(archive))
        return [
            {kind: _grouped_experts(by_key, self.local_experts, path) or by_key for kind, by_key in v.items()}
            for v in views
        ]

    def _canonical(self, key: str, e: int, offset: int, layers: set, path: str):
        """The canonical name of a local key of EP rank ``e`` (None: a replica of EP rank 0's)."""
        if key.startswith("language_model."):
            raise CheckpointError(
                f"{path}: {key!r} is the naming of Megatron's legacy (non-core) models; "
                "only megatron-core GPT models (decoder.layers.*) are read"
            )
        split, mtp = split_layer_key(key), MTP_LAYER.fullmatch(key)
        if mtp:  # an MTP layer's, as a layer's of its own (on the last stage)
            expert = split_local_expert(mtp.group(2))
            if expert is None:
                return mtp_layer_name(mtp.group(1), mtp.group(2)) if e == 0 else None
            return mtp_layer_name(mtp.group(1), expert_rest(e * self.local_experts + expert[0], expert[1]))
        if split is None or split[0] is None:
            return key if e == 0 else None
        layers.add(split[0])
        expert = split_local_expert(split[1])
        if expert is None:
            return layer_name(offset + split[0], split[1]) if e == 0 else None
        return layer_name(offset + split[0], expert_rest(e * self.local_experts + expert[0], expert[1]))

    def location(self, name: str) -> str:
        return self.files[name]

    def _shards(self, name: str, kind: str) -> Dict[int, LazyTensor]:
        return self.names[name] if kind == "model" else self.optimizer[kind][name]

    def shape(self, name: str, kind: str = "model") -> Tuple[int, ...]:
        """The global shape of a weight or its optimizer state ``kind``, from the TP shards' shapes
        (no data read)."""
        shards, dim = self._shards(name, kind), tp_dim(name)
        if sorted(shards) != list(range(self.layout[0])):
            raise CheckpointError(
                f"{self.files[name]}: {name} is stored by TP ranks {sorted(shards)}, expected 0..{self.layout[0] - 1}"
            )
        shapes = [shards[t].shape for t in range(self.layout[0])]
        rest = {s[:dim] + s[dim + 1 :] if dim is not None else s for s in shapes}
        if len(rest) != 1:
            raise CheckpointError(f"{self.files[name]}: the TP shards of {name} have shapes {shapes}")
        if dim is None:
            return shapes[0]
        return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1 :]

    def read(self, name: str, kind: str = "model") -> torch.Tensor:
        """The global tensor (or its optimizer state ``kind``): TP shards joined along Megatron's
        split dim (SwiGLU fc1: the gate halves of every shard, then the up halves)."""
        shards = self._shards(name, kind)
        if tp_dim(name) is None:
            return shards[0].read()
        return join_tp_shards(name, [shards[t].read() for t in range(self.layout[0])], self.glu)


def _grouped_experts(model: dict, local: int, path: str) -> Dict[str, LazyTensor]:
    """The state dict with GroupedMLP's experts (``--moe-grouped-gemm``, local spec: per layer
    ``mlp.experts.weight1`` [h, local experts x fc1 rows], ``weight2`` [local experts x ffn, h]) as
    SequentialMLP's ``local_experts.L.linear_fc{1,2}.weight``; empty without them. GroupedMLP
    views each as one [in, out] block per expert, so each linear weight [out, in] is a transposed
    view of its block (read on demand)."""
    if not any(_GROUPED.fullmatch(key) for key in model):
        return {}
    out = {}
    for key, tensor in model.items():
        m = _GROUPED.fullmatch(key)
        if m is None:
            out[key] = tensor
            continue
        shape, split = getattr(tensor, "shape", ()), 1 if m.group(2) == "1" else 0  # the dim holding the experts
        if (
            not isinstance(tensor, LazyTensor)
            or len(shape) != 2
            or tensor.stride != (shape[1], 1)
            or not local
            or shape[split] % local
        ):
            raise CheckpointError(
                f"{path}: model[{key!r}] is {tensor!r}, expected GroupedMLP's contiguous 2-D weight "
                f"with its {local} local experts' blocks"
            )
        rows, cols = (shape[0], shape[1] // local) if m.group(2) == "1" else (shape[0] // local, shape[1])
        for i in range(local):
            out[f"{m.group(1)}local_experts.{i}.linear_fc{m.group(2)}.weight"] = dataclasses.replace(
                tensor, offset=tensor.offset + i * rows * cols, shape=(cols, rows), stride=(1, cols)
            )
    return out


def _is_expert(key: str) -> bool:
    split = split_any_layer(key)
    return split is not None and split_local_expert(split[1]) is not None


def _adam_step(archive: TorchArchive) -> float:
    """Adam's step count: the distributed optimizer keeps it in each param group of
    ``model_optim_rng.pt``'s ``optimizer.optimizer.param_groups`` (distrib_optim.pt is beside it);
    chained optimizers (experts under EP > 1) save a list of such entries."""
    optimizer = archive.obj.get("optimizer")
    entries = optimizer if isinstance(optimizer, list) else [optimizer]
    steps = set()
    for i, entry in enumerate(entries):
        groups = entry.get("optimizer", {}).get("param_groups") if isinstance(entry, dict) else None
        where = (
            f"optimizer[{i}].optimizer.param_groups"
            if isinstance(optimizer, list)
            else "optimizer.optimizer.param_groups"
        )
        steps.add(distrib_optim.groups_step(groups, f"{archive.path}: {where}"))
    if len(steps) != 1:
        raise CheckpointError(f"{archive.path}: the chained optimizers give Adam steps {sorted(steps)}, expected one")
    return steps.pop()
