"""The time of one engine step, measured to the end of the device's work.

Owns: `StepClock`. A step's kernels are launched asynchronously on a GPU; a step that samples
nothing (an empty plan, or only partial prefill chunks) has no `.tolist()` that would wait for
them, so the wall time at return would be launch time only. `StepClock.elapsed` therefore
always synchronizes the device before it reads the timer, on every path out of a step, and
`StepResult.device_time_s` (what the online step-time model learns from) is the time until
the device finished. On CPU the synchronize is a no-op. The device hook and the timer are
arguments, so tests check the order (synchronize, then read) with fakes.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for every kernel queued on `device` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class StepClock:
    def __init__(self, sync: Callable[[], None], timer: Callable[[], float] = time.perf_counter) -> None:
        self.sync = sync
        self.timer = timer

    @classmethod
    def for_device(cls, device: torch.device) -> StepClock:
        return cls(device_sync(device))

    def start(self) -> float:
        return self.timer()

    def elapsed(self, t0: float) -> float:
        """Seconds since `t0`, read after the device has finished the step's work."""
        self.sync()
        return self.timer() - t0
