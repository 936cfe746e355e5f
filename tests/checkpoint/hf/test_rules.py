"""The pure tensor functions of the HF mapping."""
import torch

from megatron_p2r.checkpoint.hf.rules import merge_glu, merge_qkv, split_glu, split_qkv


def test_pure_mappings_round_trip():
    """split/merge of QKV and SwiGLU rows are inverse, and follow the documented layouts."""
    heads, hd, h = 2, 3, 5
    w = torch.arange(heads * 3 * hd * h, dtype=torch.float32).view(heads * 3 * hd, h)
    q, k, v = split_qkv(w, heads)
    assert torch.equal(q[hd:2 * hd], w[3 * hd:4 * hd])  # head 1's q rows follow head 0's v rows
    assert torch.equal(merge_qkv(q, k, v, heads), w)
    gate, up = split_glu(w)
    assert torch.equal(gate[1], w[2]) and torch.equal(up[1], w[3])
    assert torch.equal(merge_glu(gate, up), w)
