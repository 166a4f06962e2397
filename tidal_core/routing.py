"""Which serving unit gets a request: a pure policy over the units' reported loads.

Owns: `choose_unit` over the units' snapshots (`UnitLoad`, core/snapshot.py). The score of a unit is the delay a
new request would see there: the predicted queueing delay of its prefill backlog, plus a
penalty as its KV cache fills (a nearly full cache means preemptions or rejections soon).
With more than two units the choice is power-of-two-choices on that score, because loads
reach the router with a delay and always picking the minimum herds every request onto one
unit between reports; with one or two units it is the minimum.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tidal_core.snapshot import UnitLoad

KV_PENALTY_START = 0.8
"""KV usage above which a unit's score grows steeply (seconds of delay per unit of usage)."""
KV_PENALTY_S = 10.0


def unit_score(unit: UnitLoad) -> float:
    kv_excess = max(0.0, unit.kv_usage - KV_PENALTY_START)
    # Running count breaks ties between idle units so new work spreads out.
    return unit.queue_delay_s + KV_PENALTY_S * kv_excess + 1e-4 * (unit.num_running + unit.num_waiting)


def choose_unit(units: Sequence[UnitLoad], rng: random.Random) -> str | None:
    """The unit for one new request, or None when no unit is healthy."""
    healthy = [u for u in units if u.healthy]
    if not healthy:
        return None
    if len(healthy) <= 2:
        return min(healthy, key=unit_score).unit_id
    a, b = rng.sample(healthy, 2)
    return a.unit_id if unit_score(a) <= unit_score(b) else b.unit_id
