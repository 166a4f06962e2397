"""The API keys an Ingress replica accepts, held only as SHA-256 digests.

Owns: `key_id` (the public name of a key: `key-` + the first 12 hex digits of its SHA-256, what
logs and metrics show), `parse_keys` (the text format shared by `TIDAL_API_KEYS` and the keys
file: keys separated by commas or newlines, `#` starts a comment line), `KeySet` (digests ->
ids, looked up in constant time with `hmac.compare_digest` over every digest) and `KeyStore`
(the environment's keys plus the file's, the file re-read every `reload_period_s`: a rotated
file or Kubernetes Secret takes effect at the first request after that, with no restart and
without touching requests already admitted).

A raw key is hashed as soon as it is read and never stored, logged or exported. A file that
cannot be read keeps the previous keys (logged as a warning); an empty file means no file keys.

Must not import: ray, torch, fastapi.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# A child of Serve's logger, so the lines reach the replica's log file (Serve keeps INFO only there).
logger = logging.getLogger(f"ray.serve.{__name__}")
KEY_ID_HEX = 12
MAX_KEY_BYTES = 512
"""Longer presented tokens are refused without being hashed (no configured key is that long)."""


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


def key_id(key: str | bytes) -> str:
    raw = key.encode() if isinstance(key, str) else key
    return "key-" + hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX]


def parse_keys(text: str) -> list[str]:
    keys: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        keys += [k.strip() for k in line.split(",") if k.strip()]
    return keys


@dataclass(frozen=True)
class KeySet:
    digests: tuple[tuple[bytes, str], ...] = ()  # (sha256 digest, key id)

    @classmethod
    def of(cls, keys: Iterable[str]) -> KeySet:
        seen: dict[bytes, str] = {}
        for key in keys:
            raw = key.encode()
            if any(c.isspace() for c in key) or not key.isprintable() or len(raw) > MAX_KEY_BYTES:
                logger.warning("an API key (id %s) has whitespace or unprintable characters or is longer than "
                               "%d bytes: ignored", key_id(raw), MAX_KEY_BYTES)
                continue
            seen[_digest(raw)] = key_id(raw)
        return cls(tuple(seen.items()))

    @property
    def ids(self) -> list[str]:
        return sorted(i for _, i in self.digests)

    def __len__(self) -> int:
        return len(self.digests)

    def lookup(self, presented: bytes) -> str | None:
        """The id of the key `presented` is, or None. Every digest is compared, whichever matches."""
        if len(presented) > MAX_KEY_BYTES:
            return None
        digest = _digest(presented)
        found: str | None = None
        for stored, ident in self.digests:
            if hmac.compare_digest(stored, digest):
                found = ident
        return found

    def merged(self, other: KeySet) -> KeySet:
        return KeySet(tuple(dict(self.digests + other.digests).items()))


class KeyStore:
    """Keys from the environment (fixed at start) and from a file (re-read while serving)."""

    def __init__(self, env_keys: Iterable[str] = (), keys_file: str | None = None, reload_period_s: float = 2.0,
                 on_change: Callable[[KeySet], None] | None = None) -> None:
        self._env = KeySet.of(env_keys)
        self.keys_file = Path(keys_file) if keys_file else None
        self.reload_period_s = reload_period_s
        self.on_change = on_change
        self._file = KeySet()
        self._file_text: str | None = None
        self._next_check = float("-inf")
        self.keys = self._env
        self.reload(0.0)

    def lookup(self, presented: bytes, now: float) -> str | None:
        if now >= self._next_check:
            self.reload(now)
        return self.keys.lookup(presented)

    def current(self, now: float) -> KeySet:
        """The accepted keys now (re-reading the file when due): what a proxy gate copies."""
        if now >= self._next_check:
            self.reload(now)
        return self.keys

    def reload(self, now: float) -> bool:
        """Re-read the keys file if it changed; True when the accepted keys changed."""
        self._next_check = now + self.reload_period_s
        if self.keys_file is None:
            return False
        try:
            text = self.keys_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            logger.warning("cannot read the API keys file %s (%s): keeping the %d keys loaded before",
                           self.keys_file, type(exc).__name__, len(self.keys))
            return False
        if text == self._file_text:
            return False
        self._file_text = text
        self._file = KeySet.of(parse_keys(text))
        before = set(self.keys.ids)
        self.keys = self._env.merged(self._file)
        after = set(self.keys.ids)
        logger.info("API keys loaded from %s: %d accepted (added %s, removed %s)", self.keys_file, len(after),
                    sorted(after - before) or "none", sorted(before - after) or "none")
        if self.on_change is not None:
            self.on_change(self.keys)
        return before != after
