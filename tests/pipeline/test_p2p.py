"""Point-to-point between stages: shapes and dtypes travel with the tensor, both directions,
right peers under data parallelism, and sends never wait for the receiver."""
from __future__ import annotations

import pytest
import torch

from megatron_p2r.pipeline.p2p import DTYPES, MAX_DIMS, decode_header, encode_header


@pytest.mark.parametrize("dtype", DTYPES)
def test_header_round_trip(dtype):
    for shape in [(), (3,), (2, 16, 32), (1, 2, 3, 4, 5, 6, 7, 8)]:
        t = torch.zeros(shape, dtype=dtype)
        assert decode_header(encode_header(t)) == (dtype, shape)


def test_header_errors():
    with pytest.raises(TypeError, match="cannot send dtype torch.complex64"):
        encode_header(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=f"at most {MAX_DIMS} dimensions"):
        encode_header(torch.zeros([1] * (MAX_DIMS + 1)))
    with pytest.raises(RuntimeError, match="corrupt pipeline p2p header"):
        decode_header(torch.tensor([99, 1] + [0] * MAX_DIMS))


def test_send_recv_between_stages(world4):
    """PP=4 (middle stages send and receive both ways) and PP=2 x DP=2 (peers keep their dp):
    every stage first sends 6 tensors of varying shape and dtype forward and backward, then
    receives; each must arrive intact from the right peer, as a leaf requiring grad if float."""
    for r in world4:
        for key in ("p2p/pp4", "p2p/pp2dp2"):
            assert r[key] == {"ok": True, "grad_leaf": True}, (r["rank"], key, r[key])
