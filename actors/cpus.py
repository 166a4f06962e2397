"""How many CPUs this process may really use: what a worker sizes its threads by.

Owns: `available_cpus()` and `cgroup_cpu_limit()`. `os.cpu_count()` is the host's core count,
which a container does not get: a pod with `resources.limits.cpu: 2` on a 64-core node sees 64,
and 63 torch threads on a 2-CPU CFS quota spend most of each period throttled. So the count is the
process's affinity mask (docker `--cpuset-cpus`, taskset), capped by the cgroup's CPU quota
(docker `--cpus`, a Kubernetes CPU limit) rounded up: cgroup v2's `cpu.max` in the process's own
cgroup, else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`. No quota, or files that cannot be
read, leave the affinity count.

Must not import: torch, ray.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _v2_path(proc_cgroup: str) -> str | None:
    """The cgroup v2 path of a /proc/PID/cgroup text (its "0::/path" line), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when there is no quota or none can be
    read. `root` and `proc_cgroup` (the text of /proc/self/cgroup) are for tests."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    v2 = _v2_path(proc_cgroup)
    if v2 is not None:
        for base in (root / v2.lstrip("/"), root):  # the own cgroup; the namespace root in a container
            text = _read(base / "cpu.max")
            if text is not None:
                quota, _, period = text.partition(" ")
                if quota == "max":
                    return None
                try:
                    return int(quota) / int(period or "100000")
                except ValueError:
                    return None
    quota_text, period_text = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    try:
        quota, period = int(quota_text or "-1"), int(period_text or "0")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota rounded up
    (at least 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        count = min(count, math.ceil(limit - 1e-9))
    return max(1, count)
