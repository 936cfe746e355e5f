"""Load an exported checkpoint with Megatron-LM's own code and write its logits on given tokens.

Run by test_export_megatron_core.py with an interpreter that has megatron-core and Megatron-LM's
``megatron/training`` on its path (nothing of megatron_p2r is imported here):

    python megatron_core_load.py CHECKPOINT TOKENS.pt OUT.pt TP EP [extra Megatron flags...]

With TOKENS.pt holding {"tokens", "batch"}, Megatron also builds its DDP, non-distributed
optimizer and LR scheduler from the args, loads them with the model (``load_checkpoint``,
strict) and takes one training step on the batch before the forward on the tokens; with
"state_out" too, rank 0 saves the loaded optimizer state there by parameter name first.

With OUT.json instead, it writes the keys megatron-core's model asks a torch_dist checkpoint for
(``sharded_state_dict`` with its factories applied): {key: global shape, or null for an object}.

Megatron takes the model from the checkpoint (``--use-checkpoint-args``, so the exported args
are what builds it), builds GPTModel with the local (non-Transformer-Engine) layer spec on CPU
ranks over gloo, loads the checkpoint with ``megatron.training.checkpointing.load_checkpoint``
(strict) and runs the forward pass in eval mode; rank 0 saves the logits, gathered over TP, and
with expert biases the routers' loaded ``expert_bias`` beside them (``OUT.pt.expert_bias``). The
model is built as make_fixtures builds it (its ``_layer_specs``: the decoder block and MTP specs of
``gpt_builders.gpt_builder`` where the args ask for them; MLA's local-attention fix); with MTP
layers the logits are the output layer's last call (the model runs only with labels then).

CUDA-only calls on that path, answered on CPU without touching Megatron's math:
``get_device_arch_version`` (a warning under TP > 1) answers 10; ``read_metadata`` all-reduces
the tracker's iteration in a CUDA tensor across ranks, so it runs as if alone (every rank reads
the same file); the RNG tracker's ``fork`` is a no-op (eval mode, no dropout drawn);
``torch.cuda.current_device`` answers "cpu", ``device_count`` 1; ``Tensor.type()`` answers the
CUDA type name while the optimizer sorts parameters into fp32 / fp16 / bf16 by it; ``torch.ones``, ``tensor``,
``zeros`` and ``empty`` (asked for ``device="cuda"`` by ``get_sliding_window_causal_mask`` and
for the optimizer's scalars) place on CPU; ``moe_utils.te_general_gemm``
(undefined without Transformer Engine) is None so the router takes its ``torch.mm`` path.
"""

import contextlib
import functools
import itertools
import json
import os
import re
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fixtures", "megatron"))
import make_fixtures  # noqa: E402  (its layer specs and MLA's local-attention fix; Megatron's own code)

CPU_FLAGS = [
    "--micro-batch-size",
    "1",
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--use-cpu-initialization",
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--tokenizer-type",
    "NullTokenizer",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
]


def _work_around_cuda() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    from megatron.training import arguments, checkpointing

    arguments.get_device_arch_version = lambda: 10
    moe_utils.te_general_gemm = None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 1
    for name in ("ones", "tensor", "zeros", "empty"):  # the sliding-window mask, the optimizer's scalars
        setattr(torch, name, functools.partial(_anywhere, getattr(torch, name)))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    read_metadata = checkpointing.read_metadata

    def read_alone(tracker):
        initialized = dist.is_initialized
        dist.is_initialized = lambda: False
        try:
            return read_metadata(tracker)
        finally:
            dist.is_initialized = initialized

    checkpointing.read_metadata = read_alone


def _anywhere(factory, *args, device=None, **kwargs):
    """``factory`` with a CUDA ``device`` placed on CPU (the default device)."""
    return factory(*args, device=None if "cuda" in str(device) else device, **kwargs)


def _args(ckpt: str, tp: int, ep: int, extra):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import set_global_variables
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

    sys.argv = [
        "pretrain_gpt.py",
        "--use-checkpoint-args",
        "--load",
        ckpt,
        "--tensor-model-parallel-size",
        str(tp),
        "--expert-model-parallel-size",
        str(ep),
        *CPU_FLAGS,
        "--global-batch-size",
        str(ep),
        *extra,
    ]
    args = parse_args()
    args, _ = load_args_from_checkpoint(args)
    validate_args(args)
    saved_rows = args.padded_vocab_size
    args.padded_vocab_size = _vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    assert args.padded_vocab_size == saved_rows, (args.padded_vocab_size, saved_rows)
    set_global_variables(args, build_tokenizer=False)
    return args


def _model(args):
    """GPTModel with the local spec, as make_fixtures builds it (``_layer_specs``: the decoder
    block spec and the MTP block's with --moe-layer-freq's list form or MTP layers)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    spec, mtp_spec = make_fixtures._layer_specs(args, config, None)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def _sharded_keys(model, args) -> dict:
    """{sharded key: global shape or None (an object)} of what load_checkpoint asks for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    state = model.sharded_state_dict(metadata={"singleton_local_shards": False, "chained_optim_avoid_prefix": True})
    apply_factories(state)
    keys = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            keys[value.key] = list(value.global_shape)
        elif isinstance(value, ShardedObject):
            keys[value.unique_key] = None
    return keys


def _resume(model, args, batch, state_out=None) -> None:
    """Megatron's DDP, optimizer and LR scheduler, built from the args as
    ``setup_model_and_optimizer`` builds them (under --bf16 the model in a Float16Module) and
    loaded with the model by ``load_checkpoint``, the loaded optimizer state saved to
    ``state_out`` if given, then one training step on ``batch`` [b, s + 1], each data-parallel
    rank on its micro-batch: the mean token loss, as ``pretrain_gpt``'s loss, and the scheduler
    stepped by the global batch, as its train loop steps it."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import get_megatron_optimizer_config, get_optimizer_param_scheduler

    module = Float16Module(model.config, model) if args.bf16 else model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32)
    ddp = DistributedDataParallel(model.config, ddp_config, module)
    config, overrides = get_megatron_optimizer_config(args)
    cpu_type = torch.Tensor.type  # the optimizer sorts parameters by their CUDA type name
    torch.Tensor.type = lambda self, *a, **k: (
        cpu_type(self, *a, **k) if a or k else cpu_type(self).replace("torch.", "torch.cuda.", 1)
    )
    try:
        optimizer = get_megatron_optimizer(config, [ddp], config_overrides=overrides)
    finally:
        torch.Tensor.type = cpu_type
    scheduler = get_optimizer_param_scheduler(optimizer)
    load_checkpoint([ddp], optimizer, scheduler, strict=True)
    if state_out and dist.get_rank() == 0:
        torch.save(_loaded_state(optimizer, ddp), state_out)
    micro = args.micro_batch_size  # each data-parallel rank takes its own micro-batch of the batch
    batch = batch[mpu.get_data_parallel_rank() * micro :][:micro]
    seq = batch.shape[1] - 1
    positions = torch.arange(seq).unsqueeze(0).expand(batch.shape[0], seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(batch[:, :-1], positions, mask, labels=batch[:, 1:]).float().mean().backward()
    finalize_model_grads([ddp])
    assert optimizer.step()[0], "Megatron's step was skipped"
    scheduler.step(increment=args.global_batch_size)


def _loaded_state(optimizer, ddp) -> dict:
    """{parameter name: {"main", "exp_avg", "exp_avg_sq"}} as the loaded optimizer holds them:
    the fp32 main (the parameter itself in fp32) and its Adam moments (one rank, TP1)."""
    names = {id(p): re.sub(r"^(module\.)+", "", n) for n, p in ddp.named_parameters()}
    out = {}
    for chained in optimizer.chained_optimizers:
        pairs = [(p, p) for group in chained.optimizer.param_groups for p in group["params"]]
        if hasattr(chained, "float16_groups"):  # Float16OptimizerWithFloat16Params: (bf16 param, fp32 main)
            pairs = list(
                zip(
                    itertools.chain(*chained.float16_groups),
                    itertools.chain(*chained.fp32_from_float16_groups),
                    strict=True,
                )
            ) + [(p, p) for p in itertools.chain(*chained.fp32_from_fp32_groups)]
        for param, main in pairs:
            state = chained.optimizer.state[main]
            out[names[id(param)]] = {
                "main": main.detach().clone(),
                "exp_avg": state["exp_avg"].clone(),
                "exp_avg_sq": state["exp_avg_sq"].clone(),
            }
    return out


def _rank(rank: int, world: int, port: int, ckpt: str, tokens_path: str, out: str, tp: int, ep: int, extra) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.training.checkpointing import load_checkpoint

    _work_around_cuda()
    make_fixtures._local_attention_takes_latent_heads()
    args = _args(ckpt, tp, ep, extra)
    mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model = _model(args)
    if out.endswith(".json"):
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(_sharded_keys(model, args), fh, indent=1, sort_keys=True)
        dist.destroy_process_group()
        return
    inputs = torch.load(tokens_path, weights_only=True)
    tokens = inputs["tokens"] if isinstance(inputs, dict) else inputs
    if isinstance(inputs, dict):
        _resume(model, args, inputs["batch"], inputs.get("state_out"))
    else:
        load_checkpoint([model], None, None, strict=True)
    seq = tokens.shape[1]
    positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True: masked out
    model.eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(_logits(model, tokens, positions, mask)).float()
    if rank == 0:
        torch.save(logits, out)
        biases = {
            n: m.expert_bias.clone() for n, m in model.named_modules() if getattr(m, "expert_bias", None) is not None
        }
        if biases:  # the routers' loaded expert biases, beside the logits
            torch.save(biases, out + ".expert_bias")
    dist.barrier()
    dist.destroy_process_group()


def _logits(model, tokens, positions, mask):
    """The model's logits [b, s, v / TP]; a GPTModel with MTP layers runs only with labels (any:
    the tokens), its main logits are then the output layer's last call [s, b, v / TP], copied
    before the cross entropy overwrites them in place."""
    if model.config.mtp_num_layers is None:
        return model(tokens, positions, mask)
    seen = []
    handle = model.output_layer.register_forward_hook(lambda module, inputs, out: seen.append(out[0].clone()))
    try:
        model(tokens, positions, mask, labels=tokens)
    finally:
        handle.remove()
    return seen[-1].transpose(0, 1)


def main(argv) -> None:
    ckpt, tokens, out, tp, ep, *extra = argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = int(tp) * int(ep)
    mp.start_processes(
        _rank, args=(world, port, ckpt, tokens, out, int(tp), int(ep), extra), nprocs=world, start_method="spawn"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
