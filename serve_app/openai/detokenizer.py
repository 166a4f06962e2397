"""Token ids -> text, one token at a time, for streaming.

Owns: `IncrementalDetokenizer` (vLLM's `detokenize_incrementally` / TGI's `decode_token` idea:
decode a short window twice, with and without the newest tokens, and emit the difference; hold text
back while it ends in an incomplete UTF-8 sequence), and `TokenStrings` (the per-token strings and
bytes that logprobs show).

Why a window and not `decode([new_id])`: byte-level BPE splits one character over several tokens
(each alone decodes to U+FFFD), and SentencePiece drops a token's leading space when it is decoded
on its own. Decoding `ids[prefix:]` against `ids[prefix:read]` sees the neighbours, so the
concatenated deltas equal a full decode.

Must not import: ray, torch, fastapi, tidal_core. The tokenizer is duck-typed (Hugging Face
`decode`, `convert_ids_to_tokens`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

REPLACEMENT = "\ufffd"
# As vLLM: this many prompt tokens give the first generated token its left context (spacing).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed generated ids with `add`; `flush` at the end returns whatever is still held back."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        # Drop what no future decode window will include: keeps the work per token constant.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text):]

    def add(self, token_id: int) -> str:
        """The text this token completes (may be "" while a character or word is unfinished)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Text still held back (an unfinished UTF-8 sequence at the very end decodes to U+FFFD)."""
        return self._delta(final=True) if self._read_offset < len(self._ids) else ""


class TokenStrings:
    """The string and raw bytes of single tokens, cached (logprobs name up to 21 tokens per step)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))

    def _bytes(self, token_id: int) -> list[int]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _unicode_to_byte()
            if isinstance(piece, str) and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self._text(token_id).encode("utf-8"))


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE writes each byte as one printable char."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
