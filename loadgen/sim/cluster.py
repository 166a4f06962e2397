"""The simulated fleet: several serving units, the core routing policy, the core autoscaler.

Owns: `Fleet` — which units exist, which are provisioning (a new unit serves only after
`provisioning_s`, the time to get GPU nodes and load weights), which are draining (no new
requests; retired once empty), and their GPU-time intervals. Routing calls
`tidal_core.choose_unit` with the request's prompt size on the units' published loads, or with
`routing="prefix"` the cache-aware `PrefixAwareRouter`, or with `routing="load-blind"` the
previous prompt-blind `choose_unit`; scaling calls `tidal_core.decide`: no policy code here.
Imports the unit and the config; must not import the event loop (loadgen.sim.simulation).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from loadgen.sim.config import SimConfig
from loadgen.sim.unit import Unit, unit_load
from tidal_core import AutoscaleObservation, AutoscaleState, choose_unit, decide
from tidal_core.front_admission import published_load
from tidal_core.prefix_routing import PrefixAwareRouter, PrefixRoutingConfig


class Fleet:
    def __init__(self, config: SimConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.units: dict[int, Unit] = {}
        self.retired: list[Unit] = []
        self._next_uid = 0
        self.state = AutoscaleState()
        start = config.num_units
        if config.autoscale is not None:
            start = max(config.autoscale.min_units, min(config.autoscale.max_units, start))
        for _ in range(start):
            self._spawn(0.0, 0.0)
        self._serving: list[Unit] = list(self.units.values())
        self.prefix_router: PrefixAwareRouter | None = None
        self._prefix_choice: tuple[int, int] | None = None  # the router's last choice: (unit, cached tokens)
        if config.routing == "prefix":
            sc = config.scheduler
            self.prefix_router = PrefixAwareRouter(
                PrefixRoutingConfig(index_blocks=sc.num_kv_blocks, block_size=sc.block_size, **config.prefix_routing),
                rng)

    def _spawn(self, now: float, ready: float) -> None:
        uid = self._next_uid
        self._next_uid += 1
        self.units[uid] = Unit(uid, self.config, now, ready)

    def all_units(self) -> list[Unit]:
        return [*self.retired, *self.units.values()]

    def _refresh_serving(self, now: float) -> list[Unit]:
        self._serving = [u for u in self.units.values() if u.ready_s <= now and not u.draining]
        return self._serving

    def route(self, now: float, hashes: Sequence[int] | None = None, num_prompt_tokens: int = 0) -> Unit | None:
        self._prefix_choice = None
        serving = self._serving
        if len(serving) == 1 and not self.config.autoscale:
            return serving[0]
        serving = self._refresh_serving(now)
        if len(serving) <= 1:
            return serving[0] if serving else None
        router = self.prefix_router
        if self.config.routing == "load-blind":
            uid = choose_unit([unit_load(u, now) for u in serving], self.rng)
        elif router is None:
            uid = choose_unit([published_load(u.sched, now, str(u.uid)) for u in serving], self.rng,
                              int(num_prompt_tokens))
        else:
            uid = router.choose([published_load(u.sched, now, str(u.uid)) for u in serving], hashes,
                                num_prompt_tokens)
            if uid is not None:  # what its index recorded, taken back if the unit refuses (`on_refused`)
                self._prefix_choice = (int(uid), router.last_cached_tokens)
        return self.units[int(uid)] if uid is not None else None

    def capacity_rps(self) -> float:
        """The serving units' measured capacity together: what Serve's door spreads retries over."""
        return sum(u.sched.load.capacity_rps() for u in self._serving)

    def on_refused(self, unit: Unit, hashes: Sequence[int]) -> None:
        """`unit`, just routed a prompt of `hashes`, refused it: the cache-aware router forgets it
        (`PrefixAwareRouter.refused`; the unit never computed it)."""
        chosen, self._prefix_choice = self._prefix_choice, None
        if self.prefix_router is not None and chosen is not None and chosen[0] == unit.uid:
            self.prefix_router.refused(str(unit.uid), hashes, chosen[1])

    def tick(self, now: float) -> list[Unit]:
        """One autoscaling decision; returns units whose engine may need a kick."""
        config = self.config.autoscale
        assert config is not None
        active = [u for u in self.units.values() if not u.draining]
        ready = [u for u in active if u.ready_s <= now]
        obs = AutoscaleObservation(now, len(active), [unit_load(u, now) for u in ready])
        target, self.state = decide(obs, self.state, config)
        if target > len(active):
            for _ in range(target - len(active)):
                self._spawn(now, now + self.config.provisioning_s)
        elif target < len(active):
            # Cancel units still provisioning first, then drain the newest serving ones.
            victims = sorted(active, key=lambda u: (u.ready_s <= now, -u.uid))[: len(active) - target]
            for unit in victims:
                unit.draining = True
                self.maybe_retire(unit, now)
        self._refresh_serving(now)
        return [u for u in self.units.values() if u.draining]

    def maybe_retire(self, unit: Unit, now: float) -> None:
        if unit.draining and unit.idle and unit.uid in self.units:
            unit.end_s = now
            del self.units[unit.uid]
            self.retired.append(unit)
            if self.prefix_router is not None:
                self.prefix_router.forget(str(unit.uid))

    def snapshot(self, now: float) -> dict[str, Any]:
        serving = [u for u in self.units.values() if u.ready_s <= now and not u.draining]
        first = serving[0].sched if serving else None
        return {
            "t": now,
            "units": len(self.units),
            "serving": len(serving),
            "queue": sum(u.sched.num_waiting for u in serving),
            "running": sum(u.sched.num_running for u in serving),
            "kv_usage": max((u.sched.kv_usage() for u in serving), default=0.0),
            "load": first.load.load(now) if first else 0.0,
            "regime": first.current_regime.value if first else "none",
            "demand_units": self.state.last_demand,
            "tpot_ms_max": 1000.0 * max((u.sched.tpot.tpot_s(now) for u in serving), default=0.0),
        }

    def close(self, end: float) -> list[tuple[float, float]]:
        for unit in self.units.values():
            unit.end_s = end
        return [(u.start_s, u.end_s if u.end_s is not None else end) for u in self.all_units()]
