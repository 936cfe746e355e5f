"""The pure tensor functions of the HF mapping."""

import torch

from megatron_p2r.convert.hf.rules import merge_glu, merge_heads, split_glu, split_heads
from megatron_p2r.layout.tensor_specs import HeadRows


def test_pure_mappings_round_trip():
    """split/merge of attention rows and SwiGLU rows are inverse, and follow the documented layouts."""
    heads, hd, h = 2, 3, 5
    w = torch.arange(heads * 3 * hd * h, dtype=torch.float32).view(heads * 3 * hd, h)
    fused = HeadRows(heads, ("q", "k", "v"), hd)
    q, k, v = split_heads(w, fused)
    assert torch.equal(q[hd : 2 * hd], w[3 * hd : 4 * hd])  # head 1's q rows follow head 0's v rows
    assert torch.equal(merge_heads([q, k, v], fused), w)
    gate, up = split_glu(w)
    assert torch.equal(gate[1], w[2]) and torch.equal(up[1], w[3])
    assert torch.equal(merge_glu(gate, up), w)


def test_grouped_layouts():
    """key_value [groups, (k, v), d] and Megatron-LM's fused GQA [groups, (q x heads/groups, k, v), d]."""
    hd = 2
    kv = torch.arange(2 * 2 * hd, dtype=torch.float32)  # groups 2: k0 v0 k1 v1
    k, v = split_heads(kv, HeadRows(2, ("k", "v"), hd))
    assert k.tolist() == [0, 1, 4, 5] and v.tolist() == [2, 3, 6, 7]
    megatron = HeadRows(2, ("q", "q", "k", "v"), hd)  # q0 q1 k0 v0 | q2 q3 k1 v1
    rows = torch.arange(2 * 4 * hd, dtype=torch.float32)
    q, k, v = split_heads(rows, megatron)
    assert q.tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and k.tolist() == [4, 5, 12, 13] and v.tolist() == [6, 7, 14, 15]
    assert torch.equal(merge_heads([q, k, v], megatron), rows)
