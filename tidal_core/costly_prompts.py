"""The costliest prompts, shed in overload: a unit that cannot serve every request serves the most
within the SLO by serving the cheapest.

Owns: `CostlyPrompts`, the limit behind admission's `costly_prompt` rule (core/admission.py,
`admission.shed_costly_prompts_in_overload`, off by default).

A unit whose load (core/load.py: the arrival rate over its capacity, `LoadEstimator.overload`:
the smaller of the load over the last 2 s and over `load_tau_s`, so the overload is current and
has lasted; the seconds after a burst, which hold the slower load above 1, shed nothing) is
above 1 cannot serve every request; goodput counts requests, and what a request costs is GPU time. At saturation a
request of `p` uncached prompt tokens costs `p x a + c`: its prompt's prefill at `a` seconds a
token, plus the fixed cost of a prefill step and its share of the decode steps for the mean
output (`LoadEstimator.request_cost_s`, the terms of the capacity estimate). Serving the
cheapest first fits the most requests into the capacity, so the limit is the longest uncached
prompt such that the recent arrivals no longer than it cost, together, `1 / load` of what all of
them cost: at twice the capacity, the cheapest half of the work. Nothing is refused while the
load is at or below 1, and a prompt within the limit still meets every other rule.

The sample is the uncached prompt lengths of the last `KEPT` interactive arrivals, the refused
ones included (a front gate passes on the prompt estimates of those it refused at the door,
`absorb_door_refusals`: a sample of only what the door let through would lack the long prompts
its backlog rule refuses, and the limit would fall with every refusal). It is kept sorted as it
comes and the limit recomputed every `REFRESH` arrivals, a pass over `KEPT` lengths.

What it trades: in an overload a long prompt is refused where a shorter one is served, and a
client's retry is refused again while the overload lasts. On the simulator's sustained overloads
one A100 70B unit serves up to a quarter more requests within the SLO with it; in Serve's bursts
with retrying `openai` clients fewer requests were served in the end, the long prompts' retries
turned away again while the retry waves held the unit over capacity, which is why it is off by
default (benchmarks/RESULTS.md, "The costliest prompts, shed in overload").

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from tidal_core.sorted_window import SortedWindow

UNLIMITED = 1 << 30
"""The limit while the unit can serve every request (or has seen too few to judge)."""


class CostlyPrompts:
    KEPT = 512
    REFRESH = 16
    MIN_SEEN = 32
    __slots__ = ("_limit", "_stale", "_window")

    def __init__(self) -> None:
        self._window = SortedWindow(self.KEPT)
        self._limit = UNLIMITED
        self._stale = True  # the limit is recomputed at the next `limit_tokens`

    @property
    def num_seen(self) -> int:
        return self._window.count

    def observe(self, uncached_tokens: int) -> None:
        """An interactive arrival of `uncached_tokens` prompt tokens its unit's cache does not hold."""
        self._window.add(uncached_tokens)
        if self._window.count % self.REFRESH == 0:
            self._stale = True

    def observe_many(self, uncached_tokens: Iterable[int]) -> None:
        for n in uncached_tokens:
            self.observe(n)

    def limit_tokens(self, load_ratio: float, s_per_token: float, fixed_s: float) -> int:
        """The longest uncached prompt the unit serves at `load_ratio` (arrival rate / capacity),
        each request costing `tokens x s_per_token + fixed_s`: `UNLIMITED` at or below 1, before
        `MIN_SEEN` arrivals, or where the whole sample fits."""
        if load_ratio <= 1.0 or len(self._window.values) < self.MIN_SEEN:
            self._stale = True  # judged afresh when the overload (or the sample) comes
            return UNLIMITED
        if self._stale:
            self._stale = False
            self._limit = self._compute(load_ratio, s_per_token, fixed_s)
        return self._limit

    def _compute(self, load_ratio: float, s_per_token: float, fixed_s: float) -> int:
        ordered = self._window.values
        budget = (sum(ordered) * s_per_token + len(ordered) * fixed_s) / load_ratio
        spent, limit = 0.0, 0
        for n in ordered:
            spent += n * s_per_token + fixed_s
            if spent > budget:
                return limit
            limit = n
        return UNLIMITED
