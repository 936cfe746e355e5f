"""context.dropout: a CP rank's residual dropout keeps the one-process run's mask of its tokens."""

import pytest
import torch
import torch.nn.functional as F

from megatron_p2r.context.chunks import split_sequence
from megatron_p2r.context.dropout import sequence_dropout


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_cp_rank_gets_its_tokens_of_the_one_process_mask(cp, dtype):
    x = torch.randn(2, 16, 8).to(dtype)
    torch.manual_seed(7)
    one_process = F.dropout(x, 0.3)
    for rank in range(cp):
        torch.manual_seed(7)  # every CP rank's default stream is the one-process run's
        mine = sequence_dropout(split_sequence(x, cp, rank), 0.3, cp, rank)
        assert torch.equal(mine, split_sequence(one_process, cp, rank))


def test_the_gradient_goes_through_the_kept_rows():
    x = torch.randn(1, 8, 4, requires_grad=True)
    torch.manual_seed(3)
    y = sequence_dropout(x, 0.5, 2, 1)
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() != 0).float() * 2.0)
