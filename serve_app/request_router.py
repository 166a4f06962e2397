"""Serve request router: spreads requests over serving units with the core routing policy.

Owns: `TidalRequestRouter`, a `ray.serve` `RequestRouter` (alpha API in Ray 2.60) that runs in
the caller's process (the ingress replicas). Each unit reports its load through
`ServingUnit.record_routing_stats` (queue delay, KV usage, running/waiting, load, capacity, regime);
this class turns the reports into `UnitLoad`s and asks `tidal_core.choose_unit`. A unit
that has not reported yet counts as empty. The chosen unit is ranked first, the rest follow
(Serve falls back to them if the first refuses).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tidal_core import UnitLoad, choose_unit


class TidalRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, seed: int | None = None, **kwargs: Any) -> None:
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        rng = getattr(self, "_rng", None) or random.Random()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [UnitLoad.from_stats(uid, r.routing_stats) for uid, r in by_id.items()]
        chosen = choose_unit(loads, rng)
        if chosen is None:
            return [candidate_replicas]
        first = by_id[chosen]
        return [[first], [r for r in candidate_replicas if r is not first]]
