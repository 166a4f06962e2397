"""Chained hashes of full KV blocks: the keys of the prefix cache and of cache-aware routing.

Owns: `hash_seed` (the root of every chain: a model / adapter identity string, so two models
never share blocks), `block_hashes` (one hash per *full* block of a token sequence), and the
pair that lets a prompt be hashed once, at the front end, for both the router and the unit:
`HashScheme` (what the hashes depend on besides the tokens: a unit's block size and namespace)
and `PromptHashes` (a prompt's hashes labelled with the scheme that made them). The
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

import functools
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_DIGEST = 16
_TOKEN_BYTES = 8  # token ids packed as signed 64-bit integers


@functools.lru_cache(maxsize=64)
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


@dataclass(frozen=True)
class HashScheme:
    """What a prompt's block hashes depend on besides its tokens: the block size and the
    namespace (model / adapter identity) of the unit that will look them up."""

    block_size: int
    namespace: str

    def hash(self, token_ids: Sequence[int]) -> PromptHashes:
        """The full blocks' hashes of a prompt under this scheme (the one `block_hashes` call)."""
        return PromptHashes(self, block_hashes(token_ids, self.block_size, hash_seed(self.namespace)))


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's block hashes and the scheme that made them, carried from the front end."""

    scheme: HashScheme
    hashes: list[int]  # never mutated once made: shared by every reader of the request

    def usable_for(self, scheme: HashScheme, num_prompt_tokens: int) -> list[int] | None:
        """The hashes, if they are the ones `scheme` would compute for a prompt of this length;
        None otherwise (another namespace or block size, a count that does not fit): the reader
        then hashes the prompt itself. A hash of another namespace is never looked up, since
        equal values there say nothing about equal KV here."""
        if self.scheme != scheme or len(self.hashes) != num_prompt_tokens // scheme.block_size:
            return None
        return self.hashes
