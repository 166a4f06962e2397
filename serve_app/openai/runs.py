"""One request's engine streams: `Run` (an admitted engine request, its first chunk read, and how to
render it) and how a request's runs start and count.

Owns: `Run`, `all_or_none` (start several together; if any fails before its first token, close the
others and raise its error), `one`, and `prompt_usage` (the usage's prompt tokens: each prompt
once however many choices share it, the prefix-cache hit likewise). A /v1/completions request with
a batch of prompts is one `Run` per prompt and choice (serve_app/openai/server.py).

Must not import: ray, torch, fastapi.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from serve_app.openai.output_text import OutputText
from serve_app.openai.render import ChatRenderer, CompletionRenderer
from serve_app.unit_api import GenerateChunk
from serve_app.unit_stream import EngineStream

Renderer = CompletionRenderer | ChatRenderer


@dataclass
class Run:
    """One admitted request: its engine stream (first chunk read) and how to render it."""

    stream: EngineStream
    first: GenerateChunk
    output: OutputText
    renderer: Renderer
    num_prompt_tokens: int
    include_usage: bool
    deadline: float | None  # event-loop time after which the request is aborted
    cached_tokens: int = 0  # the prompt's prefix-cache hit, as the unit's latest chunk reported it
    counts_prompt: bool = True  # its prompt's first choice: the prompt counts once in the usage

    async def next(self) -> GenerateChunk:
        chunk = await self.stream.next(self.deadline)
        self.cached_tokens = max(self.cached_tokens, chunk.num_cached_tokens)
        return chunk


def prompt_usage(runs: Sequence[Run]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one request's runs: each prompt counted once, however
    many choices share it (OpenAI's usage for n > 1 and for a batch of prompts)."""
    counted = [run for run in runs if run.counts_prompt]
    return sum(run.num_prompt_tokens for run in counted), sum(run.cached_tokens for run in counted)


async def one(start: Awaitable[Run]) -> list[Run]:
    return [await start]


async def all_or_none(starts: Sequence[Awaitable[list[Run]]]) -> list[Run]:
    """Every start's runs, in order, started together; if any fails before its first token, the
    runs the others opened are closed and its error is raised."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    runs = [run for result in results if isinstance(result, list) for run in result]
    failure = next((result for result in results if isinstance(result, BaseException)), None)
    if failure is not None:
        for run in runs:
            await run.stream.close()
        raise failure
    return runs
