"""One request's generated text: incremental detokenization plus stop strings.

Owns: `StopStringBuffer` (finds stop strings in detokenized text, truncates before them, and holds
back the last `len(longest stop) - 1` characters while streaming so that a stop string split over
several tokens is never half-sent), and `OutputText`, which turns the router's chunks into
`TextStep`s: text safe to send now, per-token logprob records, and the finish reason.

Stop strings are matched here, on text, because only the ingress detokenizes: the router works on
token ids. A match ends the request with "stop"; the caller then closes the engine stream so the
router aborts the request instead of running to max_tokens.

Must not import: ray, torch, fastapi, tidal_core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.openai.detokenizer import IncrementalDetokenizer


class StopStringBuffer:
    """Accumulated output text; `append` reports a stop-string match, `take` releases safe text."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        # Text that could still turn out to be the start of a stop string must not be sent yet.
        self.hold = 0 if include_stop or not self.stops else max(len(s) for s in self.stops) - 1
        self.text = ""
        self.matched: str | None = None
        self._sent = 0

    def append(self, delta: str, check: bool = True) -> bool:
        """Add text; True when a stop string now matches (the text is cut at the match)."""
        if not delta or self.matched is not None:
            return False
        old_len = len(self.text)
        self.text += delta
        if not check:
            return False
        best: tuple[int, str] | None = None
        for stop in self.stops:
            # A new match must end inside `delta`, so it starts at most len(stop) - 1 chars earlier.
            at = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        self.matched = stop
        return True

    def take(self, final: bool = False) -> str:
        end = len(self.text) if final or self.matched is not None else len(self.text) - self.hold
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    alternatives: list[tuple[int, float]]  # the engine's most likely others (may hold the sampled id)
    text_offset: int  # characters of output text before this token


@dataclass(slots=True)
class TextStep:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class OutputText:
    """Feed each engine chunk to `on_chunk`; read the text to send from the returned step."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stops: Sequence[str] = (), *,
                 include_stop: bool = False, min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._buffer = StopStringBuffer(stops, include_stop)
        self._min_tokens = min_tokens
        self.num_tokens = 0
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self._buffer.text

    def on_chunk(self, token_ids: list[int], logprobs: list[list[tuple[int, float]]] | None = None,
                 finish_reason: str | None = None) -> TextStep:
        if self.finish_reason is not None:
            raise RuntimeError("OutputText received a chunk after the request finished")
        records: list[TokenLogprob] = []
        for k, token_id in enumerate(token_ids):
            self.num_tokens += 1
            if logprobs is not None and k < len(logprobs) and logprobs[k]:
                entry = logprobs[k]
                records.append(TokenLogprob(token_id, entry[0][1], list(entry[1:]), len(self._buffer.text)))
            # As vLLM: stop strings count only once min_tokens tokens exist.
            if self._buffer.append(self._detok.add(token_id), check=self.num_tokens >= self._min_tokens):
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and finish_reason is not None:
            matched = self._buffer.append(self._detok.flush(), check=self.num_tokens >= self._min_tokens)
            self.finish_reason = "stop" if matched else finish_reason
        return TextStep(self._buffer.take(final=self.finish_reason is not None), records, self.finish_reason)

    @property
    def stopped_by_string(self) -> bool:
        return self._buffer.matched is not None
