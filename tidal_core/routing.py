"""Which serving unit gets a request: a pure policy over the units' reported loads.

Owns: `choose_unit` over the units' snapshots (`UnitLoad`, core/snapshot.py), its score
`unit_score` and the admission bound `would_refuse`. The score of a unit is the delay a new
request would see there: the predicted queueing delay of its prefill backlog, plus (when the
caller knows the request's prompt size) the request's own prefill at the unit's published
`prefill_s_per_token` (so the score is the request's predicted TTFT there), plus a penalty as
its KV cache fills (a nearly full cache means preemptions or rejections soon).

With more than two units the choice is power-of-two-choices on that score, because loads
reach the router with a delay and always picking the minimum herds every request onto one
unit between reports; with one or two units it is the minimum. A request whose prompt size is
known is also sent where it will be admitted when such a unit exists: if both sampled units
would refuse it (`would_refuse`), the choice falls back to the best unit over all, first among
those that would admit it. A long prompt is what a busy unit refuses, and two busy units may be
sampled while a third is idle. Without a prompt size the choice is the prompt-blind rule.

`would_refuse` is the unit's `prefill_backlog` rule (core/admission.py) on its snapshot: work
ahead and a predicted TTFT past the unit's published `ttft_limit_s`. It ignores the time the
snapshot aged (the unit drained since), so it errs towards "refuses", which only sends the
request to a unit no worse by score. The other refusals (a full queue, a full KV cache) do
not depend on the prompt's size and are steered off by the score's KV penalty.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tidal_core.snapshot import UnitLoad

KV_PENALTY_START = 0.8
"""KV usage above which a unit's score grows steeply (seconds of delay per unit of usage)."""
KV_PENALTY_S = 10.0


def predicted_ttft_s(unit: UnitLoad, prompt_tokens: int) -> float:
    """What a request of `prompt_tokens` would wait at `unit` for its first token, by its snapshot."""
    return unit.queue_delay_s + max(0, prompt_tokens) * unit.prefill_s_per_token


def unit_score(unit: UnitLoad, prompt_tokens: int = 0) -> float:
    kv_excess = max(0.0, unit.kv_usage - KV_PENALTY_START)
    # Running count breaks ties between idle units so new work spreads out.
    return (predicted_ttft_s(unit, prompt_tokens) + KV_PENALTY_S * kv_excess
            + 1e-4 * (unit.num_running + unit.num_waiting))


def would_refuse(unit: UnitLoad, prompt_tokens: int) -> bool:
    """Whether `unit` would refuse a request of `prompt_tokens` for its prefill backlog (0 limit: never)."""
    limit = unit.ttft_limit_s
    return limit > 0.0 and unit.queue_delay_s > 0.0 and predicted_ttft_s(unit, prompt_tokens) > limit


def choose_unit(units: Sequence[UnitLoad], rng: random.Random, prompt_tokens: int | None = None) -> str | None:
    """The unit for one new request, or None when no unit is healthy. `prompt_tokens` (None:
    unknown) makes the score the request's predicted TTFT and the choice admission-aware."""
    healthy = [u for u in units if u.healthy]
    if not healthy:
        return None
    n = prompt_tokens or 0
    if len(healthy) <= 2:
        pair = healthy
    else:
        pair = rng.sample(healthy, 2)
    if prompt_tokens is not None:
        admitting = [u for u in pair if not would_refuse(u, n)]
        if not admitting:  # every sampled unit would refuse it: the best over all, admitting first
            return min(healthy, key=lambda u: (would_refuse(u, n), unit_score(u, n))).unit_id
        pair = admitting
    best = pair[0]
    for u in pair[1:]:
        if unit_score(u, n) < unit_score(best, n):
            best = u
    return best.unit_id
