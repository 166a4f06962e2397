"""A closed-loop streaming-chat load client for any OpenAI-compatible server (the same client for
tidalserve and its baselines, so a ratio compares servers, not clients).

Owns: `Workload` (prompt and output length, concurrency, request count), `fixed_length_prompts`
(chat messages whose templated prompt is exactly N tokens for the served tokenizer), `run_load`
(`concurrency` workers each sending streaming chat requests back to back, `ignore_eos` so every
request makes exactly `max_tokens` tokens) and `LoadResult` (output tokens/s, TTFT, ITL, failures
by status). Tokens are counted from each stream's `usage` chunk, as AIPerf and vLLM's own
benchmark do when the server sends one.

Usage: python -m benchmarks.chat_load --url http://127.0.0.1:8000 --concurrency 64 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Workload:
    input_tokens: int
    output_tokens: int
    concurrency: int
    num_requests: int

    @property
    def label(self) -> str:
        return f"{self.input_tokens} in / {self.output_tokens} out, concurrency {self.concurrency}"


@dataclass
class LoadResult:
    workload: Workload
    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request: (last - first token) / (tokens - 1)
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        def med(xs: list[float]) -> float | None:
            return round(statistics.median(xs), 4) if xs else None
        return {"workload": self.workload.label, "requests_ok": len(self.ttft_s), "failures": dict(self.failures),
                "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 2),
                "output_tokens_per_s": round(self.tokens_per_s, 2), "ttft_p50_s": med(self.ttft_s),
                "itl_p50_s": med(self.itl_s)}


def _prompt_len(tokenizer: Any, content: str) -> int:
    """Tokens of one user message as the server builds it (template, then encode without specials)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def fixed_length_prompts(tokenizer: Any, num_tokens: int, count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` distinct user messages whose chat-templated prompt is `num_tokens` tokens long."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and 3 <= len(w) <= 8][:5000]
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(num_tokens))
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(8):  # trim the content until the templated prompt has exactly num_tokens tokens
            n = _prompt_len(tokenizer, text)
            if n == num_tokens:
                break
            ids = ids[: max(1, len(ids) - (n - num_tokens))] if n > num_tokens else ids + ids[: num_tokens - n]
            text = tokenizer.decode(ids)
        out.append([{"role": "user", "content": text}])
    return out


async def _one(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
               result: LoadResult) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.failures[str(resp.status_code)] += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.failures["stream_error"] += 1
                    return
                if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        result.failures[type(exc).__name__] += 1
        return
    if first is None or tokens == 0:
        result.failures["no_tokens"] += 1
        return
    result.output_tokens += tokens
    result.ttft_s.append(first - start)
    if tokens > 1 and last is not None:
        result.itl_s.append((last - first) / (tokens - 1))


async def run_load(url: str, model: str, prompts: list[list[dict[str, str]]], workload: Workload,
                   timeout_s: float = 600.0) -> LoadResult:
    result = LoadResult(workload)
    queue: asyncio.Queue[list[dict[str, str]]] = asyncio.Queue()
    for i in range(workload.num_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    limits = httpx.Limits(max_connections=workload.concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                messages = queue.get_nowait()
                await _one(client, url, model, messages, workload.output_tokens, result)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        result.wall_s = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    from actors.model_loader import load_tokenizer, prepare

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=None, help="default: 2 x concurrency")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(prepare(args.model))
    workload = Workload(args.input_tokens, args.output_tokens, args.concurrency, args.requests or 2 * args.concurrency)
    prompts = fixed_length_prompts(tokenizer, workload.input_tokens, workload.num_requests)
    result = asyncio.run(run_load(args.url, args.model, prompts, workload))
    print(json.dumps(result.summary()))
    return 0 if not result.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
