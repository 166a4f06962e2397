"""Prompt text of a given approximate token length, for replaying traces against a real server.

Owns `build_prompt`: real English prose (an original passage shipped beside this file,
`prompt_passage.txt`) cut or repeated to about `num_tokens` tokens. Traces carry token counts,
not text; the replay client turns each count into a prompt with this, and the server's own
tokenizer then reports the true count.

The length is an estimate: English prose runs at about 0.75 words per token for Llama-family
tokenizers (docs/traces.md records a measurement on this passage), so we take
round(0.75 * num_tokens) words. The seed picks the starting word, so different seeds give
different prefixes (no accidental prefix-cache hits) and the same seed the same text.

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
