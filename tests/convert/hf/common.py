"""Helpers of the Hugging Face tests: our reference model, built without convert/hf, and the
comparison of two models as functions."""

import re

import torch
import transformers

from megatron_p2r.checkpoint.io import load_checkpoint
from megatron_p2r.checkpoint.metadata import metadata_config, read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.parallel.state import ParallelState

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 logits, same weights: reduction order only
ROPE = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
GQA = dict(group_query_attention=True)


def reference_model(src, tmp):
    """Our one-process model with SRC's weights, via reshard/delink + load_checkpoint (not convert/hf)."""
    from megatron_p2r.training import build_train_state

    meta = read_metadata(resolve_iteration_dir(src))
    pseudo = meta["p2r"]["phase"] == "pseudo"
    convert(src, tmp, Target(1, 1, None, 1), DelinkOptions() if pseudo else None, progress=False)
    cfg = metadata_config(read_metadata(resolve_iteration_dir(tmp)))
    state = build_train_state(cfg, ParallelState.single())
    load_checkpoint(tmp, state, finetune=True)
    return state.model.eval(), cfg


def greedy(model, prompt, steps=10):
    """Our greedy decoding: the whole sequence again at each step, argmax of the last logits."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(tokens=ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def load_hf(directory, unexpected=None):
    """transformers' model of DIRECTORY, every tensor loaded; ``unexpected``: a pattern that some
    tensors transformers skips must all match (DeepSeek's prediction layers)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    skipped = info.pop("unexpected_keys")
    assert not any(info[k] for k in ("missing_keys", "mismatched_keys")), info
    assert (bool(skipped) and all(re.match(unexpected, k) for k in skipped)) if unexpected else not skipped, skipped
    model.generation_config.eos_token_id = None  # generate exactly 10 tokens, as our loop does
    model.generation_config.pad_token_id = 0
    return model.eval()


def check_same_function(ours, theirs, vocab, seq, seed=0, generate=True):
    """Logits on random ids, and 10 greedy tokens from a 6-token prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    with torch.no_grad():
        a, b = ours(tokens=ids), theirs(input_ids=ids).logits
    assert a.abs().max() > 0.5  # trained enough for the comparison to mean something
    torch.testing.assert_close(b, a[..., : b.shape[-1]], **TOL)
    if not generate:
        return
    prompt = ids[:, :6]
    with torch.no_grad():
        hf_ids = theirs.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(hf_ids, greedy(ours, prompt))
