"""When the request reached the server: stamped by Serve's proxy, trusted only when signed.

Owns: `ArrivalKey` (one application's signing key: `stamp()` in the proxy, `verify()` in the
Ingress), `ARRIVAL_HEADER`, `restamp()` (the proxy replaces whatever a client sent under that
header with its own stamp) and `mark_arrival()` (the Ingress's arrival time for a request, read
once per request by its middlewares).

Why: a client's TTFT starts when its request reaches the proxy, but a unit's admission could only
see the Ingress's clock; in a burst a request can wait in the proxy and on the way to an Ingress
replica for a large share of its TTFT target, and the unit then admitted requests whose first token
could no longer come in time (docs/reliability.md, the burst section). With the proxy's stamp the
Ingress's gate and the unit's admission both judge the time already spent in front of them.

Why signed: the header travels in the request, so a client could send one. A forged old arrival
would not only get its own request refused: TTFT metrics and the unit's TTFT correction (the
predictor learns from measured TTFTs) would read it, and every client would be refused more. So
the stamp carries a keyed BLAKE2b tag of its time; the key is made once per application build
(serve_app/app.py) and handed to every Ingress replica in its arguments, and the proxy reads it
from an Ingress with the API-key digests (serve_app/proxy_gate.py). A stamp that does not verify,
or lies outside [now - `MAX_STAMP_AGE_S`, now + `MAX_CLOCK_SKEW_S`], is ignored: the Ingress's own
clock is used, as without a proxy gate. During a rebuild the proxy may hold the old key for up to
its refresh period; those stamps fail and fall back the same way.

Must not import: ray, torch, transformers.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from starlette.types import Scope

ARRIVAL_HEADER = b"x-tidal-arrival"
MAX_STAMP_AGE_S = 60.0  # the unit's bound on front-end delay (serve_app/engine_loop.py)
MAX_CLOCK_SKEW_S = 1.0  # a proxy on another node may run a little ahead of the Ingress's clock
_SCOPE_KEY = "tidal.arrival_s"


class ArrivalKey:
    """One application's signing key (hex, 64 characters: 32 random bytes)."""

    __slots__ = ("_key", "hex")

    def __init__(self, key_hex: str | None = None) -> None:
        self.hex = key_hex or secrets.token_hex(32)
        self._key = bytes.fromhex(self.hex)
        if len(self._key) < 16:
            raise ValueError("arrival key: at least 16 bytes (32 hex characters)")

    def _tag(self, when: bytes) -> bytes:
        return hashlib.blake2b(when, key=self._key, digest_size=16).hexdigest().encode()

    def stamp(self, now: float) -> bytes:
        """The header value for a request that arrived at `now` (wall clock)."""
        when = f"{now:.6f}".encode()
        return when + b":" + self._tag(when)

    def verify(self, value: bytes, now: float) -> float | None:
        """The stamped arrival time, or None if the stamp is not this key's or is out of bounds."""
        when, sep, tag = value.partition(b":")
        if not sep or not hmac.compare_digest(tag, self._tag(when)):
            return None
        try:
            arrival = float(when)
        except ValueError:
            return None
        if not now - MAX_STAMP_AGE_S <= arrival <= now + MAX_CLOCK_SKEW_S:
            return None
        return min(arrival, now)


def restamp(scope: Scope, key: ArrivalKey, now: float) -> None:
    """Replace any `ARRIVAL_HEADER` in the request with this proxy's stamp for `now`."""
    headers = [h for h in scope.get("headers") or () if h[0] != ARRIVAL_HEADER]
    headers.append((ARRIVAL_HEADER, key.stamp(now)))
    scope["headers"] = headers


def mark_arrival(scope: Scope, key: ArrivalKey | None, clock: Callable[[], float] = time.time,
                 on_stamped: Callable[[float], None] | None = None) -> float:
    """The request's arrival (wall clock): the proxy's verified stamp, else now. Computed once per
    request and kept in the scope; also written to `request.state.arrival_s` (a fresh state dict:
    servers may hand every request the same lifespan-state mapping). `on_stamped` is told the
    delay from a verified stamp to now (the `tidal_front_delay_seconds` histogram)."""
    found = scope.get(_SCOPE_KEY)
    if found is not None:
        return float(found)
    now = clock()
    arrival = now
    if key is not None:
        for name, value in scope.get("headers") or ():
            if name == ARRIVAL_HEADER:
                verified = key.verify(value, now)
                if verified is not None:
                    arrival = verified
                    if on_stamped is not None:
                        on_stamped(now - verified)
                break
    scope[_SCOPE_KEY] = arrival
    scope["state"] = {**scope.get("state", {}), "arrival_s": arrival}
    return arrival
