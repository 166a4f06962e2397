"""Per-key request and token limits (OpenAI's RPM / TPM) as token buckets.

Owns: `KeyLimits` (requests and tokens per minute of one API key; None = unlimited),
`TokenBucket` and `RateLimiter` (one pair of buckets per key id: `admit` before any work,
`charge` for tokens as they are consumed).

Each bucket holds a minute's allowance and refills continuously at limit/60 per second, so a
key may burst up to its whole minute at once and then gets limit/60 per second. A request costs
one request token at admission. Tokens are not known at admission (the prompt is not even read
yet), so they are charged as they are used (prompt, then every generated token) and the token
bucket may go into debt; while it is in debt the key's new requests are refused until refills pay
it back. The retry-after of a refusal is exactly the time until the bucket would admit again.

Must not import: anything outside the standard library, or read the wall clock (time is an
argument).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SECONDS_PER_MINUTE = 60.0
MIN_RETRY_AFTER_S = 0.001

LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("rpm", self.rpm), ("tpm", self.tpm)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: a limit is a whole number of at least 1 per minute "
                                 "(or None for no limit)")


@dataclass(slots=True)
class TokenBucket:
    """`capacity` tokens, refilled at `capacity / 60` per second; `level` may go negative (debt)."""

    capacity: float
    level: float
    updated_s: float

    @classmethod
    def full(cls, per_minute: int, now: float) -> TokenBucket:
        return cls(float(per_minute), float(per_minute), now)

    @property
    def rate_per_s(self) -> float:
        return self.capacity / SECONDS_PER_MINUTE

    def refill(self, now: float) -> None:
        if now > self.updated_s:
            self.level = min(self.capacity, self.level + (now - self.updated_s) * self.rate_per_s)
            self.updated_s = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` (0 when it does now)."""
        self.refill(now)
        if self.level >= amount:
            return 0.0
        return max(MIN_RETRY_AFTER_S, (amount - self.level) / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    kind: LimitKind | None = None  # which limit refused
    limit: int | None = None
    retry_after_s: float = 0.0
    remaining_requests: int | None = None


@dataclass(slots=True)
class _KeyState:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass
class RateLimiter:
    """The buckets of every key id seen. Keys without a limit cost nothing."""

    default: KeyLimits = field(default_factory=KeyLimits)
    per_key: dict[str, KeyLimits] = field(default_factory=dict)
    _state: dict[str, _KeyState] = field(default_factory=dict)

    def limits(self, key_id: str) -> KeyLimits:
        return self.per_key.get(key_id, self.default)

    def _key(self, key_id: str, now: float) -> _KeyState:
        state = self._state.get(key_id)
        if state is None:
            lim = self.limits(key_id)
            state = self._state[key_id] = _KeyState(
                TokenBucket.full(lim.rpm, now) if lim.rpm else None,
                TokenBucket.full(lim.tpm, now) if lim.tpm else None)
        return state

    def admit(self, key_id: str, now: float) -> Verdict:
        """Take one request from the key's allowance, or say which limit refuses and for how long."""
        state = self._key(key_id, now)
        lim = self.limits(key_id)
        if state.tokens is not None:
            wait = state.tokens.wait_for(1, now)  # not in debt: at least one token left
            if wait > 0:
                return Verdict(False, "tokens", lim.tpm, wait)
        if state.requests is None:
            return Verdict(True)
        wait = state.requests.wait_for(1, now)
        if wait > 0:
            return Verdict(False, "requests", lim.rpm, wait, 0)
        state.requests.take(1, now)
        return Verdict(True, remaining_requests=int(state.requests.level))

    def charge(self, key_id: str, tokens: int, now: float) -> None:
        """Count `tokens` (prompt or generated) against the key's per-minute token allowance."""
        state = self._key(key_id, now)
        if state.tokens is not None and tokens > 0:
            state.tokens.take(tokens, now)

    def forget(self, keep: set[str]) -> None:
        """Drop the buckets of keys no longer configured (after a rotation)."""
        for key_id in [k for k in self._state if k not in keep]:
            del self._state[key_id]
