"""What a worker sizes its threads by (actors/cpus.py): the affinity mask, capped by a cgroup CPU quota
(v2's cpu.max in the process's own cgroup or the namespace root, else v1's cfs files), rounded up."""

from __future__ import annotations

import os
from pathlib import Path

from actors.cpus import available_cpus, cgroup_cpu_limit

V1_ONLY = "4:memory:/x\n1:cpu:/\n"  # no "0::" line: a v1 host


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_in_the_process_cgroup_or_the_namespace_root(tmp_path: Path) -> None:
    _write(tmp_path / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1\n") == 2.5
    _write(tmp_path / "cpu.max", "50000 100000\n")  # a container sees its own cgroup as the root
    assert cgroup_cpu_limit(tmp_path, "0::/\n") == 0.5
    assert cgroup_cpu_limit(tmp_path, "0::/elsewhere\n") == 0.5
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") is None


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path, V1_ONLY) is None  # nothing readable: no cap
    _write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(tmp_path, V1_ONLY) is None
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "300000\n")
    assert cgroup_cpu_limit(tmp_path, V1_ONLY) == 3.0
    # A hybrid host: the v2 hierarchy has no cpu controller at the root, so v1's files decide.
    assert cgroup_cpu_limit(tmp_path, "0::/\n" + V1_ONLY) == 3.0


def test_available_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path, V1_ONLY) == affinity  # no quota
    _write(tmp_path / "cpu.max", "150000 100000\n")
    assert available_cpus(tmp_path, "0::/\n") == min(affinity, 2)  # 1.5 CPUs: two threads, not one
    _write(tmp_path / "cpu.max", "1000 100000\n")
    assert available_cpus(tmp_path, "0::/\n") == 1  # never below one
    _write(tmp_path / "cpu.max", "6400000 100000\n")
    assert available_cpus(tmp_path, "0::/\n") == affinity  # a quota above the mask does not add CPUs
