"""The replicas' heap trimming (serve_app/memory_trim.py): the period knob, and that the task
really calls glibc's malloc_trim and that the call gives freed heap memory back."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from serve_app import memory_trim


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
