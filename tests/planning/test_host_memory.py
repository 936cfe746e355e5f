"""The memory the preflight compares against, read from a fake /proc and /sys/fs/cgroup: cgroup
v2 at the mount root and nested (a SLURM step, a systemd scope), cgroup v1's memory hierarchy,
and the tightest limit along the path."""

import pytest

from megatron_p2r.config import ConfigError
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning import preflight
from megatron_p2r.planning.host_memory import available_host_memory, cgroup_headroom
from tests.helpers import tiny_config

GiB = 2**30
MEMINFO = "MemTotal:       25165824 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB


def fake_host(tmp_path, cgroup_lines, files):
    """``tmp/proc`` with meminfo and self/cgroup, ``tmp/cgroup`` with ``files`` {relative path: text}."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    cgroup.mkdir()
    for rel, text in files.items():
        (cgroup / rel).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / rel).write_text(text)
    return str(proc), str(cgroup)


def test_no_cgroup_limit_is_meminfo(tmp_path):
    proc, cgroup = fake_host(tmp_path, ["0::/"], {"memory.max": "max\n", "memory.current": "123\n"})
    assert cgroup_headroom(proc, cgroup) is None
    assert available_host_memory(proc, cgroup) == 20 * GiB


def test_v2_at_the_mount_root(tmp_path):
    proc, cgroup = fake_host(tmp_path, ["0::/"], {"memory.max": f"{GiB}\n", "memory.current": f"{GiB // 4}\n"})
    assert available_host_memory(proc, cgroup) == 3 * GiB // 4


def test_v2_nested_takes_the_tightest_level_and_discounts_inactive_cache(tmp_path):
    """A SLURM step three levels down: the job's limit (2 GiB, 1.5 GiB used of which 0.5 GiB
    inactive page cache) binds, not the step's own (4 GiB) nor the root's (none)."""
    step = "system.slice/slurmstepd.scope/job_42/step_0"
    proc, cgroup = fake_host(
        tmp_path,
        [f"0::/{step}"],
        {
            "memory.max": "max\n",
            "system.slice/memory.max": "max\n",
            "system.slice/memory.current": f"{5 * GiB}\n",
            "system.slice/slurmstepd.scope/job_42/memory.max": f"{2 * GiB}\n",
            "system.slice/slurmstepd.scope/job_42/memory.current": f"{3 * GiB // 2}\n",
            "system.slice/slurmstepd.scope/job_42/memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
            f"{step}/memory.max": f"{4 * GiB}\n",
            f"{step}/memory.current": f"{GiB}\n",
        },
    )
    assert available_host_memory(proc, cgroup) == GiB
    # without the step directory (a container that sees its cgroup from outside): the levels that exist
    proc, cgroup = fake_host(tmp_path / "x", ["0::/docker/abc"], {"memory.max": f"{GiB}\n", "memory.current": "0\n"})
    assert available_host_memory(proc, cgroup) == GiB


def test_v1_memory_hierarchy(tmp_path):
    """cgroup v1 (this machine's kind): the memory controller's own line and mount; an unlimited
    level reads as 2^63 - 4096 and does not bind."""
    proc, cgroup = fake_host(
        tmp_path,
        ["12:pids:/", "4:memory:/process_api/abc", "1:cpu,cpuacct:/", "0::/"],
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": f"{GiB}\n",
            "memory/process_api/memory.limit_in_bytes": f"{3 * GiB}\n",
            "memory/process_api/memory.usage_in_bytes": f"{GiB}\n",
            "memory/process_api/abc/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/process_api/abc/memory.usage_in_bytes": f"{GiB // 2}\n",
            "memory/process_api/abc/memory.stat": f"total_inactive_file {GiB // 4}\n",
        },
    )
    assert available_host_memory(proc, cgroup) == 2 * GiB


def test_unreadable_files_are_no_limit(tmp_path):
    proc, cgroup = fake_host(tmp_path, ["garbage", "0::/a"], {"a/memory.max": "lots\n", "a/memory.current": "0\n"})
    assert available_host_memory(proc, cgroup) == 20 * GiB
    assert available_host_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_a_nested_limit_refuses_a_run_with_an_error(tmp_path, monkeypatch):
    """What the preflight does with it: the run's estimate against the tightest level."""
    proc, cgroup = fake_host(tmp_path, ["0::/job/step"], {"job/memory.max": f"{2**16}\n", "job/memory.current": "0\n"})
    monkeypatch.setattr(preflight, "available_host_memory", lambda: available_host_memory(proc, cgroup))
    cfg = tiny_config()
    with pytest.raises(ConfigError, match=r"this run does not fit in memory: .* the machine has 0.1 MiB available"):
        preflight.check_memory(cfg, ParallelPlan.for_world(cfg, 1), 0, "cpu")
