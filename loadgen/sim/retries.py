"""Retrying clients in the simulator: a refused request comes back the way the openai client sends it.

Owns: `RetryingClients` — the retries waiting to be sent (a heap keyed by time then sequence, so
ties break deterministically), each original request's attempt count and the send time of its
latest attempt, and the counters the study reports: load amplification (attempts / original
requests), retries sent, retries admitted, and how many of those waited the server's
`Retry-After` rather than the client's own backoff. The rules are `loadgen.retry_policy.RetryPolicy`
(the openai client's: two retries, `Retry-After` honoured as sent, backoff with jitter otherwise).

The `Retry-After` a refused client gets is what Serve's front door sends: every 429's retry-after
is spread over the units' measured capacity (`tidal_core.RetrySpread`, as serve_app/front_gate.py
does for each 429, whoever decided it), to the millisecond (`retry-after-ms`, which the openai
client reads first). Refusal k of a burst is told to come back about k / capacity later, so the
retries of a burst return in a stream the units can take, not as one wave a second later (what
the unit's own estimate, rounded up to whole seconds, would say to most of them). A 503 (no unit
could take the request) carries Serve's fixed `NO_UNIT_RETRY_AFTER_S`, not spread.

The simulation measures TTFT and E2E from the send of the attempt that got in (what the server
sees, and what Serve's metrics measure); `client_outcomes` gives the same requests timed from the
first send, as the person behind the client waits. Same trace, seed and policy: same result.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from typing import Any

import numpy as np

from loadgen.records import Trace
from loadgen.report import RunOutcomes
from loadgen.retry_policy import RetryPolicy, retry_after_header_s
from tidal_core import Rejection
from tidal_core.retry_spread import RetrySpread, retry_after_ms

# In Serve, a request no unit can take (all provisioning or draining) is a 503 with this Retry-After.
NO_UNIT_RETRY_AFTER_S = 5.0


class RetryingClients:
    def __init__(self, policy: RetryPolicy, trace: Trace, seed: int = 0, max_retry_after_s: float = 60.0) -> None:
        n = len(trace)
        self.policy = policy
        self.rng = random.Random(seed * 7919 + 17)
        self.spread = RetrySpread(max_retry_after_s)  # the front door's (admission.max_retry_after_s)
        self.first_s = trace.arrival_s.astype(np.float64)
        self.sent_s = self.first_s.copy()  # send time of each request's latest attempt
        self.attempts = np.ones(n, np.int32)
        self._at_retry_after = np.zeros(n, bool)  # the latest attempt waited the server's Retry-After
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self.counters = {"retries_sent": 0, "retries_admitted": 0, "retries_at_retry_after": 0,
                         "admitted_at_retry_after": 0, "rejected_again": 0, "gave_up": 0, "not_retryable": 0}
        self.by_attempt: dict[int, dict[str, int]] = {}

    @property
    def next_s(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def pop(self) -> tuple[float, int]:
        """The next retry due: (its send time, the request's trace index); counts it as sent."""
        t, _, i = heapq.heappop(self._heap)
        self.sent_s[i] = t
        self.attempts[i] += 1
        self.counters["retries_sent"] += 1
        self.counters["retries_at_retry_after"] += int(self._at_retry_after[i])
        self._count(int(self.attempts[i]), "sent")
        return t, i

    def on_rejected(self, i: int, now: float, rejection: Rejection | None, capacity_rps: float = 0.0) -> None:
        """Request `i` was refused at `now` (`rejection` None: no unit could take it, a 503);
        `capacity_rps` is the serving units' measured capacity together, which the door spreads
        the retries over (0: the unit's own estimate, in whole seconds)."""
        if self.attempts[i] > 1:
            self.counters["rejected_again"] += 1
        if rejection is not None and not rejection.retryable:
            self.counters["not_retryable"] += 1  # a 400: the client does not retry it
            return
        header = self.retry_after_s(now, rejection, capacity_rps)
        delay = self.policy.delay_s(int(self.attempts[i]) - 1, header, self.rng)
        if delay is None:
            self.counters["gave_up"] += int(self.policy.max_retries > 0)  # out of retries, or Retry-After > 120 s
            return
        self._at_retry_after[i] = self.policy.honours_retry_after(header)
        self._seq += 1
        heapq.heappush(self._heap, (now + delay, self._seq, i))

    def retry_after_s(self, now: float, rejection: Rejection | None, capacity_rps: float) -> float:
        """The delay the refused client is told: spread like Serve's door does (`retry-after-ms`),
        or, without a measured capacity, the unit's estimate as `Retry-After` (whole seconds)."""
        if rejection is None:
            return retry_after_header_s(NO_UNIT_RETRY_AFTER_S)
        if not capacity_rps > 0.0 or not math.isfinite(capacity_rps):
            return retry_after_header_s(rejection.retry_after_s)
        delay = self.spread.delay_s(now, rejection.retry_after_s, capacity_rps, self.rng.random())
        return retry_after_ms(delay) / 1000.0

    def on_admitted(self, i: int) -> None:
        attempt = int(self.attempts[i])
        if attempt > 1:
            self.counters["retries_admitted"] += 1
            self.counters["admitted_at_retry_after"] += int(self._at_retry_after[i])
            self._count(attempt, "admitted")

    def _count(self, attempt: int, key: str) -> None:
        row = self.by_attempt.setdefault(attempt, {"sent": 0, "admitted": 0})
        row[key] += 1

    def client_outcomes(self, out: RunOutcomes) -> RunOutcomes:
        """`out` with TTFT and E2E from each request's first send (the wait a user sees)."""
        lost = self.sent_s - self.first_s
        return dataclasses.replace(out, ttft_s=out.ttft_s + lost, e2e_s=out.e2e_s + lost, extra={})

    def summary(self) -> dict[str, Any]:
        n = int(self.attempts.size)
        c = self.counters
        sent = c["retries_sent"]
        at_ra = c["retries_at_retry_after"]
        return {
            "policy": dataclasses.asdict(self.policy),
            "original_requests": n,
            "attempts": int(self.attempts.sum()),
            "amplification": round(float(self.attempts.sum()) / n, 4) if n else None,
            **c,
            "retry_admit_rate": round(c["retries_admitted"] / sent, 4) if sent else None,
            "retry_after_admit_rate": round(c["admitted_at_retry_after"] / at_ra, 4) if at_ra else None,
            "by_attempt": {str(k): v for k, v in sorted(self.by_attempt.items())},
        }
