"""When a client retries a refused request, and after how long: the official `openai` client's rules.

Owns: `RetryPolicy` (the rules as data) and `retry_after_header_s` (what our server puts in the
`Retry-After` header for a rejection's estimate). Used by the simulator's retrying clients
(loadgen/sim/retries.py) and by `tidal replay --retries`, so both retry the way a user's client
does. The rules, as the openai Python client has them (read from its source, v3.57):

- `max_retries` = 2 by default: a refused request is sent at most three times;
- retried statuses: 408, 409, 429 and every 5xx, plus connection errors and timeouts before a
  response (a stream that fails after its 200 is not retried); an `x-should-retry` header
  overrides the status (our server never sends one);
- the delay: a server-given `retry-after-ms` (preferred) or `Retry-After` in seconds, used as is,
  without jitter, when 0 < value <= 120 s; a larger value means no retry at all; otherwise
  (no header, or 0) exponential backoff 0.5 s x 2^retries_taken, capped at 8 s, shortened by a
  uniform 0-25% jitter.

Our server sends `Retry-After` in whole seconds, rounded up, at least 1 (serve_app/openai/errors.py),
so every client refused within the same second comes back at the same instant.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

RETRY_STATUSES = frozenset({408, 409, 429})
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 120.0


def retry_after_header_s(estimate_s: float | None, default_s: float = 1.0) -> float:
    """The `Retry-After` value our server sends for a rejection's estimate: whole seconds, >= 1."""
    value = default_s if estimate_s is None or not math.isfinite(estimate_s) else estimate_s
    return float(max(1, math.ceil(value)))


@dataclass(frozen=True)
class RetryPolicy:
    """A client's retry rules; the defaults are the openai client's (`max_retries=2`)."""

    max_retries: int = 2
    initial_delay_s: float = INITIAL_RETRY_DELAY_S
    max_delay_s: float = MAX_RETRY_DELAY_S
    max_retry_after_s: float = MAX_RETRY_AFTER_S
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries} must be >= 0 (0 turns retries off)")
        if not 0.0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError(f"initial_delay_s={self.initial_delay_s} must be > 0 and <= max_delay_s")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"jitter={self.jitter} must be in [0, 1)")

    @staticmethod
    def retryable_status(http_status: int | None) -> bool:
        """None stands for no response at all (connection error, timeout): retried too."""
        return http_status is None or http_status in RETRY_STATUSES or http_status >= 500

    def delay_s(self, retries_taken: int, retry_after_s: float | None, rng: random.Random) -> float | None:
        """Seconds to wait before retry number `retries_taken + 1`, or None: give up.

        `retry_after_s` is the server's header value (None when it sent none).
        """
        if retries_taken >= self.max_retries:
            return None
        if retry_after_s is not None and math.isfinite(retry_after_s):
            if retry_after_s > self.max_retry_after_s:
                return None
            if retry_after_s > 0:
                return retry_after_s
        backoff = min(self.initial_delay_s * 2.0 ** min(retries_taken, 1000), self.max_delay_s)
        return max(0.0, backoff * (1.0 - self.jitter * rng.random()))

    def honours_retry_after(self, retry_after_s: float | None) -> bool:
        """True when the delay is the server's header (not the client's own backoff)."""
        return (retry_after_s is not None and math.isfinite(retry_after_s)
                and 0 < retry_after_s <= self.max_retry_after_s)
