"""The replicas' heap trimming (serve_app/memory_trim.py): the period knob, and that the task
really calls glibc's malloc_trim and that the call gives freed heap memory back; and the
jemalloc counts the soak reads (`jemalloc_stats`), in a process really running on Ray's jemalloc."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app import memory_trim

ROOT = Path(__file__).resolve().parents[2]


def test_period_defaults_parses_and_rejects_bad_values() -> None:
    assert memory_trim.period_s({}) == memory_trim.DEFAULT_PERIOD_S
    assert memory_trim.period_s({memory_trim.ENV: "2.5"}) == 2.5
    assert memory_trim.period_s({memory_trim.ENV: "0"}) == 0
    for bad in ("soon", "-1"):
        with pytest.raises(ValueError, match=memory_trim.ENV):
            memory_trim.period_s({memory_trim.ENV: bad})


def test_off_starts_nothing() -> None:
    async def main() -> None:
        assert memory_trim.start_trimming({memory_trim.ENV: "0"}) is None

    asyncio.run(main())


def test_the_task_calls_the_trim_on_its_period(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(memory_trim, "malloc_trim", lambda: calls.append)

    async def main() -> None:
        task = memory_trim.start_trimming({memory_trim.ENV: "0.01"})
        assert task is not None
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(main())
    assert len(calls) >= 3 and set(calls) == {0}


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(memory_trim.malloc_trim() is None, reason="no glibc malloc_trim here")
def test_malloc_trim_gives_freed_heap_back() -> None:
    trim = memory_trim.malloc_trim()
    assert trim is not None
    # Many mid-sized malloc blocks (below the mmap threshold, so they live in the heap), one kept
    # at the top so the heap cannot shrink by itself when the rest is freed.
    blocks = [ctypes.create_string_buffer(64 * 1024) for _ in range(1500)]
    keep = blocks[-1]
    del blocks[-1]
    blocks.clear()
    before = _rss_kb()
    trim(0)
    after = _rss_kb()
    assert keep.raw[:1] == b"\x00"
    assert before - after > 40 * 1024, (before, after)  # most of the ~94 MB freed comes back


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "mallctl", None) is not None, reason="this process runs on jemalloc")
def test_jemalloc_stats_is_none_on_the_system_allocator() -> None:
    assert memory_trim.jemalloc_stats() is None


RAY_JEMALLOC = memory_trim.ray_jemalloc()


@pytest.mark.skipif(RAY_JEMALLOC is None, reason="this Ray install ships no jemalloc")
def test_jemalloc_stats_count_live_bytes_under_rays_jemalloc() -> None:
    # A child process on the jemalloc Ray ships (as `benchmarks/soak.py --allocator jemalloc`
    # runs the cluster): 64 MB allocated and freed must show in the live count, and resident
    # memory must cover what is live.
    child = (
        "import json\n"
        "from serve_app.memory_trim import jemalloc_stats\n"
        "a = jemalloc_stats()\n"
        "buf = bytearray(64 << 20)\n"
        "b = jemalloc_stats()\n"
        "del buf\n"
        "c = jemalloc_stats()\n"
        "print(json.dumps([a, b, c]))\n"
    )
    env = {**os.environ, "LD_PRELOAD": str(RAY_JEMALLOC), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60, check=True)
    a, b, c = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(a) == set(memory_trim.JEMALLOC_STATS)
    assert b["allocated"] - a["allocated"] >= 64 << 20
    assert b["allocated"] - c["allocated"] >= 64 << 20
    assert b["resident"] >= b["allocated"] and b["mapped"] >= b["resident"]
