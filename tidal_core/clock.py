"""Clocks. The core never reads time itself: drivers pass `now` in.

Owns: the `Clock` protocol and `VirtualClock` (the simulator's). The wall clock lives at the
edge (serve_app/unit.py) because reading it here would make the core impure.

Must not import: ray, torch, transformers, fastapi, asyncio, time.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class VirtualClock:
    """A clock that only moves when told to, and never backwards."""

    __slots__ = ("_now",)

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance_to(self, t_s: float) -> None:
        if t_s < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t_s}")
        self._now = t_s

    def advance_by(self, dt_s: float) -> None:
        self.advance_to(self._now + dt_s)
