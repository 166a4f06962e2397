"""One snapshot of a serving unit: what routing, autoscaling, the simulator and metrics read.

Owns: `UnitLoad`, the record `Scheduler.snapshot(now)` returns, and its one wire form
(`to_stats` / `from_stats`): the flat dict of floats a Serve replica reports through
`record_routing_stats` and `record_autoscaling_stats`. The regime travels as its level
(`REGIME_LEVEL`, the same number the `tidal_regime` gauge exports), and nowhere else is it
encoded another way.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tidal_core.cached_fit import uncached_tokens
from tidal_core.regime import REGIME_LEVEL, Regime

_REGIME_BY_LEVEL = {level: regime for regime, level in REGIME_LEVEL.items()}


@dataclass(frozen=True, slots=True)
class UnitLoad:
    """A unit's state at one instant. `queue_delay_s` is the predicted queueing delay a new
    request would see (the admission's and the router's score); `load` is utilisation (see
    core/load.py) against `capacity_rps`, the measured service capacity. `prefill_s_per_token` is
    what one more prompt token would add to a new request's predicted TTFT (0: not published),
    so a front end can add a request's own prefill to `queue_delay_s`, and `num_arrived` counts the
    requests it has received, so a front end can tell how many it sent are still on the way
    (tidal_core/front_admission.py). `tpot_s` is the unit's measured recent time per output token
    (core/tpot_meter.py; 0: none measured) and `target_tpot_s` its TPOT target (0: none), the
    autoscaler's hot-unit signal; `refused_fraction` the recent share of its interactive arrivals
    refused for an SLO reason (core/refusal_meter.py; 0: none arrived lately), its refusal signal.
    `ttft_limit_s` is the predicted TTFT past which its admission refuses a request that has work
    ahead (the regime's limit; 0: not published, or the unit never refuses for it), so a router
    can send a long prompt where it will be admitted (core/routing.py). `burst_s_per_token` is
    `prefill_s_per_token` for the last of a burst of prompts arriving together (each one a decode
    in the later steps of the others' prefill, so a burst's tokens cost more each; 0: not
    published), so a front end can price the requests it let through that have not arrived yet.
    `alone_limit_tokens` is the longest prompt, in tokens not found in its prefix cache, that the
    unit would start now with nothing ahead (0: no such limit: it is not in OVERLOAD, or its
    `prompt_over_target` rule is off); min(P, `cached_fixed_tokens`) + `cached_share` x the rest
    is about how many tokens of an arriving prompt of P tokens its prefix cache holds (both 0:
    none, or no cache; core/cached_fit.py), so a front end that cannot see the cache can
    estimate the part of a prompt the unit's rules count (`uncached_tokens`; core/admission.py).
    `costly_limit_tokens` is the longest uncached prompt the unit serves while over its capacity
    (0: no such limit; core/costly_prompts.py) and `overload_clear_s` when its load estimate would
    fall to 1 if nothing else arrived (a `costly_prompt` refusal's retry-after).

    The batch class (core/batch_lane.py) is reported apart so an autoscaler can count
    interactive demand only: `num_waiting`, `queue_delay_s` and `kv_usage` are interactive
    (batch work yields its slots and KV to them); `num_running` is every running request, of
    which `batch_running` are batch; `batch_waiting` requests (`batch_backlog_tokens` prompt
    tokens, queued or not yet computed) wait for headroom; `batch_kv_usage` is the share of the
    KV pool batch requests hold; `batch_load` is the part of `load` batch arrivals make (0 while
    the load estimate counts interactive arrivals only, as the scheduler's does)."""

    unit_id: str
    num_running: int
    num_waiting: int
    queue_delay_s: float
    kv_usage: float
    load: float = 0.0
    capacity_rps: float = 0.0
    regime: Regime = Regime.LIGHT
    healthy: bool = True
    prefill_s_per_token: float = 0.0
    num_arrived: int = 0  # requests the unit has received since it started (admitted or not)
    tpot_s: float = 0.0
    target_tpot_s: float = 0.0
    batch_load: float = 0.0
    batch_waiting: int = 0
    batch_backlog_tokens: int = 0
    batch_running: int = 0
    batch_kv_usage: float = 0.0
    refused_fraction: float = 0.0  # recent share of interactive arrivals refused (core/refusal_meter.py)
    ttft_limit_s: float = 0.0  # predicted TTFT past which the unit refuses a request with work ahead (0: never)
    burst_s_per_token: float = 0.0  # `prefill_s_per_token` for prompts arriving together (0: not published)
    alone_limit_tokens: int = 0  # longest uncached prompt started now with nothing ahead (0: no limit)
    cached_share: float = 0.0  # share cached of an arriving prompt's tokens past `cached_fixed_tokens`
    costly_limit_tokens: int = 0  # longest uncached prompt served now, over capacity (0: no limit)
    overload_clear_s: float = 0.0  # seconds until the load would decay to 1 with no arrival (0: at or below)
    cached_fixed_tokens: float = 0.0  # cached tokens per arriving prompt whatever its length (core/cached_fit.py)

    def uncached_tokens(self, prompt_tokens: int, num_prompts: int = 1) -> int:
        """The tokens of `num_prompts` prompts of `prompt_tokens` in all that this unit's prefix
        cache would not hold, on the line it published (the front end cannot look them up)."""
        return uncached_tokens(prompt_tokens, self.cached_fixed_tokens, self.cached_share, num_prompts)

    def to_stats(self) -> dict[str, float]:
        """The wire form: floats only (Serve's stats contract); the unit id is the replica's."""
        return {
            "num_running": float(self.num_running),
            "num_waiting": float(self.num_waiting),
            "queue_delay_s": self.queue_delay_s,
            "kv_usage": self.kv_usage,
            "load": self.load,
            "capacity_rps": self.capacity_rps,
            "regime": float(REGIME_LEVEL[self.regime]),
            "prefill_s_per_token": self.prefill_s_per_token,
            "num_arrived": float(self.num_arrived),
            "tpot_s": self.tpot_s,
            "target_tpot_s": self.target_tpot_s,
            "batch_load": self.batch_load,
            "batch_waiting": float(self.batch_waiting),
            "batch_backlog_tokens": float(self.batch_backlog_tokens),
            "batch_running": float(self.batch_running),
            "batch_kv_usage": self.batch_kv_usage,
            "refused_fraction": self.refused_fraction,
            "ttft_limit_s": self.ttft_limit_s,
            "burst_s_per_token": self.burst_s_per_token,
            "alone_limit_tokens": float(self.alone_limit_tokens),
            "cached_share": self.cached_share,
            "costly_limit_tokens": float(self.costly_limit_tokens),
            "overload_clear_s": self.overload_clear_s,
            "cached_fixed_tokens": self.cached_fixed_tokens,
        }

    @classmethod
    def from_stats(cls, unit_id: str, stats: Mapping[str, float] | None) -> UnitLoad:
        """Reads `to_stats`'s form; a unit that has not reported yet reads as idle."""
        s = stats or {}
        return cls(unit_id, int(s.get("num_running", 0)), int(s.get("num_waiting", 0)),
                   float(s.get("queue_delay_s", 0.0)), float(s.get("kv_usage", 0.0)), float(s.get("load", 0.0)),
                   float(s.get("capacity_rps", 0.0)), _REGIME_BY_LEVEL.get(int(s.get("regime", 0)), Regime.LIGHT),
                   prefill_s_per_token=float(s.get("prefill_s_per_token", 0.0)),
                   num_arrived=int(s.get("num_arrived", 0)), tpot_s=float(s.get("tpot_s", 0.0)),
                   target_tpot_s=float(s.get("target_tpot_s", 0.0)), batch_load=float(s.get("batch_load", 0.0)),
                   batch_waiting=int(s.get("batch_waiting", 0)),
                   batch_backlog_tokens=int(s.get("batch_backlog_tokens", 0)),
                   batch_running=int(s.get("batch_running", 0)), batch_kv_usage=float(s.get("batch_kv_usage", 0.0)),
                   refused_fraction=float(s.get("refused_fraction", 0.0)),
                   ttft_limit_s=float(s.get("ttft_limit_s", 0.0)),
                   burst_s_per_token=float(s.get("burst_s_per_token", 0.0)),
                   alone_limit_tokens=int(s.get("alone_limit_tokens", 0)),
                   cached_share=float(s.get("cached_share", 0.0)),
                   costly_limit_tokens=int(s.get("costly_limit_tokens", 0)),
                   overload_clear_s=float(s.get("overload_clear_s", 0.0)),
                   cached_fixed_tokens=float(s.get("cached_fixed_tokens", 0.0)))


STAT_KEYS: tuple[str, ...] = tuple(UnitLoad("", 0, 0, 0.0, 0.0).to_stats())
"""The keys of the wire form, in order (what an autoscaling policy reads back per replica)."""
