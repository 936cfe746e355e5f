"""The host step's link (optim/host_step.py): what the DDP and the offload manager, built before
the optimizer, call on the host step the optimizer builds later."""

import pytest

from megatron_p2r.optim.host_step import HostStepLink


class _Stepper:
    def __init__(self):
        self.calls = []

    def wait(self, key=None):
        self.calls.append(("wait", key))

    def reduction_started(self, bucket):
        self.calls.append(("started", bucket))


def test_the_link_forwards_to_the_stepper_it_is_connected_to_once():
    made = []
    link = HostStepLink(
        starts_in_backward=True, make_nvme=lambda stepper, layers: made.append((stepper, layers)) or "file"
    )
    link.wait(3)  # a fetch before the optimizer exists waits for nothing
    assert link.nvme is None
    stepper, layers = _Stepper(), {3: ["shard"]}
    link.connect(stepper, layers)
    link.wait(3)
    link.reduction_started("bucket")
    assert stepper.calls == [("wait", 3), ("started", "bucket")]
    assert made == [(stepper, layers)] and link.nvme == "file"
    with pytest.raises(RuntimeError, match="connected to one host step"):
        link.connect(_Stepper(), layers)
