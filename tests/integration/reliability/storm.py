"""Disconnect storms: many streaming clients leaving at seeded random points.

Owns `Storm` (the storm's shape) and `disconnect_storm` (one outcome per client: HTTP status, SSE
lines read, finished or cut, the error body of a refusal).

Must not import torch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np


@dataclass(frozen=True)
class Storm:
    """`clients` streaming requests started over `spread_s`, each cut at a random point (seeded):
    half after a random time (possibly before the response headers, while queued or prefilling),
    half after a random number of SSE lines (mid-decode). Short ones may finish first."""

    clients: int
    seed: int
    prompt_tokens: tuple[int, int] = (40, 600)
    max_tokens: tuple[int, int] = (16, 400)
    spread_s: float = 2.0
    cut_after_s: tuple[float, float] = (0.0, 4.0)
    cut_after_lines: tuple[int, int] = (0, 60)


async def _storm_client(client: httpx.AsyncClient, base_url: str, model: str, i: int, rng: np.random.Generator,
                        storm: Storm) -> dict[str, Any]:
    from loadgen.prompts import build_prompt

    await asyncio.sleep(float(rng.uniform(0.0, storm.spread_s)))
    prompt = build_prompt(int(rng.integers(*storm.prompt_tokens)), seed=storm.seed * 7919 + i)
    body: dict[str, Any] = {"model": model, "stream": True, "ignore_eos": bool(rng.random() < 0.5),
                            "max_tokens": int(rng.integers(*storm.max_tokens))}
    chat = bool(rng.random() < 0.5)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    by_time = bool(rng.random() < 0.5)
    cut_s = float(rng.uniform(*storm.cut_after_s)) if by_time else None
    cut_lines = None if by_time else int(rng.integers(*storm.cut_after_lines))
    out: dict[str, Any] = {"i": i, "chat": chat, "cut_s": cut_s, "cut_lines": cut_lines, "status": None,
                           "lines": 0, "done": False, "cut": False, "error": None, "retry_after": None}
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def read() -> None:
        async with client.stream("POST", base_url + path, json=body) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                # The headers first: a cut can land while the body is still being read.
                out["retry_after"] = response.headers.get("retry-after")
                out["error"] = (await response.aread())[:300].decode("utf-8", "replace")
                return
            async for line in response.aiter_lines():
                if not line:
                    continue
                out["lines"] += 1
                if line == "data: [DONE]":
                    out["done"] = True
                if cut_lines is not None and out["lines"] >= cut_lines and not out["done"]:
                    out["cut"] = True
                    return  # leaving the block closes the unread response: the connection drops

    try:
        await asyncio.wait_for(read(), cut_s)
    except TimeoutError:
        out["cut"] = True
    return out


async def disconnect_storm(base_url: str, model: str, storm: Storm) -> list[dict[str, Any]]:
    """Run the storm; one outcome per client (HTTP status, SSE lines read, finished or cut)."""
    rng = np.random.default_rng(storm.seed)
    seeds = rng.integers(0, 2**31, size=storm.clients)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0), limits=limits) as client:
        return await asyncio.gather(*(_storm_client(client, base_url, model, i, np.random.default_rng(int(seed)),
                                                    storm) for i, seed in enumerate(seeds)))


