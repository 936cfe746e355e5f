"""The registry of CUDA-only code (tests/cuda/registry.py) against the package as it is: every
construct the scan (tests/cuda/scan.py) finds has a line naming the lane test that runs it on a
GPU, every line still matches a construct, every named test exists. Reading only: milliseconds."""

from tests.cuda import scan
from tests.cuda.registry import BEHAVIOURS, CUDA_ONLY, E

SNIPPET = """
import torch

def fetch(x, device, group):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if x.device.type != "cpu" and dist.get_backend(group) == "nccl":
        y = x.pin_memory()
    z = torch.empty(3, pin_memory=True).copy_(x, non_blocking=True)
    return z.to("cpu"), x.cpu(), torch.device("cuda", 0), x.is_cuda

class Kernels:
    def run(self, q, k, v, groups):
        s = torch.cuda.Stream()
        s.wait_event(torch.cuda.Event())
        q.record_stream(s)
        torch.optim.AdamW(groups, fused=True)
        return F.scaled_dot_product_attention(q, k, v), F.grouped_mm(q, k), torch.compile(v)

def innocent(x, device):
    x.to(device, non_blocking=False)
    torch.empty(1, pin_memory=False)
    return device.type == "meta", x.to(torch.float32)
"""


def test_the_registry_names_a_lane_test_for_every_cuda_only_construct():
    problems = scan.audit(scan.scan_package(), CUDA_ONLY, BEHAVIOURS)
    assert not problems, "\n\n".join(problems)


def test_the_scan_finds_each_kind_of_construct_under_its_anchor():
    found = {(c.anchor, c.construct) for c in scan.scan_source("x.py", SNIPPET)}
    assert found == {
        ("fetch", 'device == "cuda"'),
        ("fetch", "torch.cuda.synchronize"),
        ("fetch", 'device != "cpu"'),
        ("fetch", 'backend == "nccl"'),
        ("fetch", ".pin_memory()"),
        ("fetch", "pin_memory=True"),
        ("fetch", "non_blocking=True"),
        ("fetch", '.to("cpu")'),
        ("fetch", ".cpu()"),
        ("fetch", 'torch.device("cuda")'),
        ("fetch", ".is_cuda"),
        ("Kernels.run", "torch.cuda.Stream"),
        ("Kernels.run", ".wait_event()"),
        ("Kernels.run", "torch.cuda.Event"),
        ("Kernels.run", ".record_stream()"),
        ("Kernels.run", "fused=True"),
        ("Kernels.run", "scaled_dot_product_attention"),
        ("Kernels.run", "grouped_mm"),
        ("Kernels.run", "torch.compile"),
    }, found


def _new_problems(found, registry=CUDA_ONLY, behaviours=BEHAVIOURS) -> list:
    """The audit's problems beyond those of the package and registry as they are (none when the
    registry is complete; this keeps one missing line failing one test, the first)."""
    known = set(scan.audit(scan.scan_package(), CUDA_ONLY, BEHAVIOURS))
    return [p for p in scan.audit(found, registry, behaviours) if p not in known]


def _with(extra_source: str, file: str = "offload/runtime.py"):
    """The package's constructs as if ``extra_source`` were appended to ``file``."""
    with open(f"{scan.ROOT}/megatron_p2r/{file}", encoding="utf-8") as fh:
        source = fh.read() + extra_source
    return [c for c in scan.scan_package() if c.file != file] + scan.scan_source(file, source)


def test_a_new_synchronize_without_a_line_fails_with_the_line_to_add():
    found = _with("\n\ndef wait_for_copies(device):\n    torch.cuda.synchronize(device)\n")
    problems = _new_problems(found)
    assert len(problems) == 1 and problems[0].startswith("unregistered: megatron_p2r/offload/runtime.py:"), problems
    assert problems[0].endswith(
        '\n    E("offload/runtime.py", "wait_for_copies", "torch.cuda.synchronize", '
        '"tests/cuda/<module>.py::<the test that runs it on CUDA>"),'
    ), problems[0]


def test_a_construct_added_where_others_are_registered_suggests_their_test():
    found = _with("\n\nclass OffloadManager:\n    def to_host(self):\n        torch.cuda.synchronize()\n")
    problems = _new_problems(found)
    assert len(problems) == 1 and '"torch.cuda.synchronize", "tests/cuda/test_host_paths.py::' in problems[0], problems


def test_stale_lines_and_missing_tests_fail():
    gone = E(
        "offload/runtime.py",
        "OffloadManager.prefetch_all",
        "torch.cuda.synchronize",
        "tests/cuda/test_offload.py::test_offload_prefetch_copies_overlap_compute",
    )
    untested = E(*CUDA_ONLY[0][:3], "tests/cuda/test_numerics.py::test_that_was_renamed")
    wrong_param = E(
        *CUDA_ONLY[0][:3], "tests/cuda/test_numerics.py::test_training_step_matches_cpu_fp32_reference[fp8]"
    )
    moved = E("optim/host_step.py", "HostStepThatMoved", "host step in backward", CUDA_ONLY[0].test)
    registry = [e for e in CUDA_ONLY if e != CUDA_ONLY[0]] + [gone, untested, wrong_param]
    problems = _new_problems(scan.scan_package(), registry, [*BEHAVIOURS, moved])
    assert [p.split(":")[0] for p in problems] == [
        "stale",
        "stale behaviour",
        "no such lane test",
        "no such lane test",
    ], problems
    assert "OffloadManager.prefetch_all" in problems[0] and "HostStepThatMoved" in problems[1]
    assert "test_that_was_renamed" in problems[2] and "[fp8]" in problems[3]
