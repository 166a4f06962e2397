"""Spreading the retries of refused requests, so the second wave of a burst does not arrive as one.

Owns: `RetrySpread.delay_s` and `retry_after_ms` (the delay as the `retry-after-ms` header sends
it). Clients honour `Retry-After` (the official OpenAI client retries a 429 twice, sleeping
exactly what the server says); if every refusal of a burst says "1 s", the whole burst comes back
one second later, and again. Instead each refusal is given the next free
*retry slot*: slots are `1 / capacity_rps` apart (the rate the units can take new requests),
starting no earlier than the refusal's own estimate (`base_s`, the time until the unit would
admit again), with a jitter inside the slot so two front ends do not line up. Refusal k of a
burst is therefore told to come back about k / capacity later: its position in the queue it
would have joined. Past `max_s` the slots stop (no client is told to wait longer than the unit
would ever say); the refusals beyond it are spread uniformly over [base_s, max_s].

Several front ends keep one schedule each, so the fleet's retries come back at (front ends) x
capacity; the jitter keeps them apart, and the unit's own admission still refuses what it
cannot serve.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math


def retry_after_ms(delay_s: float) -> int:
    """`delay_s` as the `retry-after-ms` header carries it (which the OpenAI clients read first):
    whole milliseconds, at least 1. Serve's front door sends it; the simulator's clients wait it."""
    return max(1, round(delay_s * 1000))


class RetrySpread:
    __slots__ = ("_next_slot_s", "max_s")

    def __init__(self, max_s: float) -> None:
        if not max_s > 0.0:
            raise ValueError(f"retry spread max_s={max_s} must be > 0 (the longest Retry-After, in seconds)")
        self.max_s = max_s
        self._next_slot_s = -math.inf

    def delay_s(self, now: float, base_s: float, capacity_rps: float, u: float) -> float:
        """Seconds this refusal's client should wait. `u` in [0, 1) is a uniform random draw
        (the caller's generator: the core keeps no randomness of its own)."""
        if not 0.0 <= u < 1.0:
            raise ValueError(f"u={u} must be a uniform draw in [0, 1)")
        base = min(max(0.0, base_s), self.max_s)
        if capacity_rps <= 0.0 or not math.isfinite(capacity_rps):
            return base  # no measured rate to spread by: the unit's own estimate
        gap = 1.0 / capacity_rps
        slot = max(self._next_slot_s, now + base)
        delay = slot - now + u * gap
        if delay > self.max_s:
            return base + u * (self.max_s - base)
        self._next_slot_s = slot + gap
        return delay

    @property
    def next_slot_s(self) -> float:
        """When the next refusal's slot starts (-inf before the first)."""
        return self._next_slot_s
