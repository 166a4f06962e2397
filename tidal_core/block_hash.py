"""Chained hashes of full KV blocks: the keys of the prefix cache and of cache-aware routing.

Owns: `hash_seed` (the root of every chain: a model / adapter identity string, so two models
never share blocks) and `block_hashes` (one hash per *full* block of a token sequence). The
hash of block k covers the hash of block k-1 and block k's token ids, so equal hashes mean an
equal whole prefix, not just an equal block. A partial last block gets no hash: it is never
shared.

The hash is BLAKE2b with a 128-bit digest, not Python's `hash()`: the block table is shared by
every client of a unit, and a hash an attacker can collide on purpose would let one client's
prompt read another's KV. Cost: about 4 us per 16-token block on a CPU core (an 8k-token prompt
hashes in ~2 ms, once per request).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_DIGEST = 16
_TOKEN_BYTES = 8  # token ids packed as signed 64-bit integers


def hash_seed(namespace: str) -> int:
    """The chain's root for a model / adapter identity (the empty string is a valid identity)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=_DIGEST, person=b"tidal-kv").digest(),
                          "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int, *, start: int = 0,
                 parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block number `start` on.

    `parent` is the hash of block `start - 1` (required when `start > 0`); the result extends a
    list computed earlier for a prefix of the same sequence.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if start > 0 and parent is None:
        raise ValueError("block_hashes(start > 0) needs the parent hash of block start - 1")
    n = len(token_ids) // block_size
    if n <= start:
        return []
    buf = array("q", token_ids[start * block_size:n * block_size]).tobytes()
    step = block_size * _TOKEN_BYTES
    prev = (seed if parent is None else parent).to_bytes(_DIGEST, "little")
    blake, out = hashlib.blake2b, []
    for off in range(0, len(buf), step):
        prev = blake(prev + buf[off:off + step], digest_size=_DIGEST).digest()
        out.append(int.from_bytes(prev, "little"))
    return out
