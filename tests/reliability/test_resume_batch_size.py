"""Resuming with another --global-batch-size: the consumed samples carry over (Megatron-LM's
rule) and the run continues on the samples after them, instead of running out of data."""

from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.training import pretrain
from tests.checkpoint.common import cfg_of


def test_a_resume_with_a_smaller_global_batch_continues_after_the_consumed_samples(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    first = pretrain(cfg_of(save=ck, global_batch_size=8, train_iters=4, exit_interval=2))
    assert len(first["losses"]) == 2
    second = pretrain(cfg_of(save=ck, load=ck, global_batch_size=4, train_iters=4))
    assert len(second["losses"]) == 2
    assert "the 16 consumed samples carry over" in capsys.readouterr().out
    meta = read_metadata(resolve_iteration_dir(ck))
    assert (meta["iteration"], meta["consumed_samples"]) == (4, 2 * 8 + 2 * 4)
