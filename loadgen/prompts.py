"""Prompt text of a given approximate token length, for replaying traces against a real server.

Owns `build_prompt`: real English prose (an original passage shipped beside this file,
`prompt_passage.txt`) cut or repeated to about `num_tokens` tokens. Traces carry token counts,
not text; the replay client turns each count into a prompt with this, and the server's own
tokenizer then reports the true count.

The length is an estimate: English prose runs at about 0.75 words per token for Llama-family
tokenizers (docs/traces.md records a measurement on this passage), so we take
round(0.75 * num_tokens) words. The seed picks the starting word, so different seeds give
different prefixes (no accidental prefix-cache hits) and the same seed the same text.

`build_prefixed_prompt` keeps a trace's prefix structure (Mooncake's `hash_ids`, a trace's
`prefix_ids`): the prompt is one piece of text per prefix block, the same id always giving the
same words, so two prompts whose ids agree on their first k blocks agree on their first k blocks
of text, and a server's prefix cache sees the sharing the trace recorded. Pieces join at a space,
where a Llama-family or GPT-2-style tokenizer always starts a new token, so shared text is shared
tokens up to the last shared word.

Must not import serve_app, actors, ray, torch or transformers.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

PASSAGE_FILE = Path(__file__).with_name("prompt_passage.txt")
WORDS_PER_TOKEN = 0.75


@functools.cache
def _words() -> tuple[str, ...]:
    words = tuple(PASSAGE_FILE.read_text(encoding="utf-8").split())
    if not words:
        raise ValueError(f"{PASSAGE_FILE.name} is empty")
    return words


def build_prompt(num_tokens: int, seed: int, *, words_per_token: float = WORDS_PER_TOKEN) -> str:
    """English text of roughly `num_tokens` tokens (empty for 0); deterministic for a seed.

    `words_per_token` tunes the estimate for a known tokenizer (docs/traces.md has measurements).
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if not 0.0 < words_per_token < 10.0:
        raise ValueError(f"words_per_token={words_per_token} must be in (0, 10); English is ~0.75")
    if num_tokens == 0:
        return ""
    words = _words()
    count = max(1, round(num_tokens * words_per_token))
    start = random.Random(seed).randrange(len(words))
    whole, rest = divmod(start + count, len(words))
    if whole == 0:
        return " ".join(words[start:start + count])
    # Wrap around the passage as often as needed.
    pieces = [*words[start:], *(words * (whole - 1)), *words[:rest]]
    return " ".join(pieces)


@functools.lru_cache(maxsize=4096)
def _block_words(block_id: int, seed: int, count: int) -> str:
    return build_prompt(count, seed=hash((seed, block_id)) & 0x7FFF_FFFF, words_per_token=1.0)


def build_prefixed_prompt(prefix_ids: tuple[int, ...] | list[int], num_tokens: int, block_tokens: int, seed: int = 0,
                          *, words_per_token: float = WORDS_PER_TOKEN) -> str:
    """English text of roughly `num_tokens` tokens made of one piece per id of `prefix_ids`, each
    piece about `block_tokens` tokens (the last one what is left) and the same for the same
    (id, seed): prompts that share their first ids share their first pieces' text. Ids past the
    prompt's length are ignored; a prompt longer than its ids gets a last piece of its own.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens} must be >= 1")
    if not 0.0 < words_per_token < 10.0:
        raise ValueError(f"words_per_token={words_per_token} must be in (0, 10); English is ~0.75")
    words_left = max(1, round(num_tokens * words_per_token)) if num_tokens else 0
    block_words = max(1, round(block_tokens * words_per_token))
    pieces: list[str] = []
    for block_id in prefix_ids:
        if words_left <= 0:
            break
        take = min(block_words, words_left)
        # A partial last block is the start of the same id's full piece, as its tokens are.
        full = _block_words(int(block_id), seed, block_words)
        pieces.append(full if take == block_words else " ".join(full.split(" ", take)[:take]))
        words_left -= take
    if words_left > 0:  # more prompt than ids: text of its own, not shared
        tail_seed = hash((seed, tuple(prefix_ids), num_tokens)) & 0x7FFF_FFFF
        pieces.append(build_prompt(words_left, seed=tail_seed, words_per_token=1.0))
    return " ".join(pieces)
