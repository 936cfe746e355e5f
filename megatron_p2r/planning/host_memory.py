"""How much memory this process can still take: the host's ``MemAvailable``, lowered by every
memory cgroup limit above the process.

A job rarely sits at the cgroup mount's root: a SLURM step, a systemd scope or a Kubernetes
container is a cgroup some levels down, and any level on the way up may hold the binding limit.
So the path is read from ``/proc/self/cgroup`` and every directory from the process's cgroup
up to the mount is asked, on cgroup v2 (``memory.max``, ``memory.current``) and on cgroup v1's
memory hierarchy (``memory.limit_in_bytes``, ``memory.usage_in_bytes``); the headroom is the
smallest ``limit - usage`` found. Usage counts page cache, which the kernel reclaims before it
kills anything, so the inactive file pages (``memory.stat``) are not counted as used (what
``docker stats`` does). A path that does not exist under the mount (a container that sees its
own cgroup as the root without a cgroup namespace) is walked from its deepest existing
directory. Both roots are parameters, so tests read a fake tree.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Tuple

# (hierarchy, limit file, usage file, memory.stat key of the inactive page cache)
_V2 = ("", "memory.max", "memory.current", "inactive_file")
_V1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _read_int(path: str) -> Optional[int]:
    """The integer in ``path``; None when it is missing, unreadable or "max" (no limit)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        return int(text)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _stat_value(directory: str, key: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat"), encoding="ascii") as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return 0


def mem_available(proc_root: str = "/proc") -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None when it cannot be read)."""
    try:
        with open(os.path.join(proc_root, "meminfo"), encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return None


def _memory_cgroups(proc_root: str) -> List[Tuple[Tuple[str, str, str, str], str]]:
    """(the hierarchy's files, this process's path in it) for the v2 hierarchy and v1's memory
    controller, from ``/proc/self/cgroup`` (lines ``id:controllers:path``)."""
    found = []
    try:
        with open(os.path.join(proc_root, "self", "cgroup"), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found.append((_V2, path))
        elif "memory" in controllers.split(","):
            found.append((_V1, path))
    return found


def _levels(mount: str, path: str) -> Iterator[str]:
    """The directories from ``mount/path`` (its deepest existing one) up to ``mount``."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(mount, *parts[:depth])
        if os.path.isdir(directory):
            yield directory


def cgroup_headroom(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The least ``limit - usage`` (bytes) over the memory cgroups above this process; None when
    no level sets a limit."""
    headroom = None
    for (hierarchy, limit_file, usage_file, inactive_key), path in _memory_cgroups(proc_root):
        for directory in _levels(os.path.join(cgroup_root, hierarchy), path):
            limit = _read_int(os.path.join(directory, limit_file))
            usage = _read_int(os.path.join(directory, usage_file))
            if limit is None or usage is None:
                continue
            free = limit - max(0, usage - _stat_value(directory, inactive_key))
            headroom = free if headroom is None else min(headroom, free)
    return headroom


def available_host_memory(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process can still take: MemAvailable, or the tightest cgroup headroom when lower."""
    found = [n for n in (mem_available(proc_root), cgroup_headroom(proc_root, cgroup_root)) if n is not None]
    return min(found) if found else None
