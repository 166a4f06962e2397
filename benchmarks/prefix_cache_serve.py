"""Prefix caching on the dev server: TTFT of a request whose ~600-token system prompt is cached,
against the first request with that prompt, side by side in one run.

`serve run configs/local.yaml` (SmolLM2 on CPU, prefix caching on as shipped) on a free port, one
warm-up request, then for each of `--prompts` different system prompts (benchmarks/system_prompts.py,
~600 tokens each): the first request (nothing cached), the same request again (the whole prompt
but its last block cached), and one with the same system prompt and another question. Each is a
streaming chat through the official `openai` client, greedy, `max_tokens` 16, one at a time; TTFT
is the client's time to the first content chunk. Reported per prompt and as medians: the ratio
second / first (the goal: <= 1/3), whether the greedy text is identical, and the cached tokens
the server reported. With `--uncached` the same sequence also runs against a second server with
`enable_prefix_caching: false` (the control: there the second request must not get faster).

Usage: python -m benchmarks.prefix_cache_serve --out runs/prefix_cache_serve [--prompts 5] [--uncached]
       python -m benchmarks.prefix_cache_serve --url http://127.0.0.1:8000   (a server already running)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import yaml

from benchmarks.system_prompts import system_prompt
from benchmarks.vs_vllm_cpu import ROOT, first_answer, stop_server, tidal_server

MODEL = "smollm2-135m-instruct"
QUESTIONS = ("Can a refund be escalated?", "Who approves a replacement?")


def timed_chat(client: openai.OpenAI, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streaming greedy chat: TTFT to the first content chunk, the text, the usage."""
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": question}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft_s": round(ttft, 4) if ttft is not None else None, "text": "".join(parts),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": details.cached_tokens if details is not None else None}


def run_sequence(url: str, prompts: list[int], max_tokens: int) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    timed_chat(client, "You are brief.", "Say hi.", 4)  # warm-up: the first step of a process is slow
    rows = []
    for index in prompts:
        system = system_prompt(index)
        first = timed_chat(client, system, QUESTIONS[0], max_tokens)
        second = timed_chat(client, system, QUESTIONS[0], max_tokens)
        other = timed_chat(client, system, QUESTIONS[1], max_tokens)
        row = {"prompt": index, "first": first, "second": second, "other_question": other,
               "ratio_second_over_first": _ratio(second, first), "ratio_other_over_first": _ratio(other, first),
               "identical_text": second["text"] == first["text"]}
        rows.append(row)
        print(f"  prompt {index}: TTFT {first['ttft_s']} -> {second['ttft_s']} s (x{row['ratio_second_over_first']}),"
              f" other question {other['ttft_s']} s; cached {first['cached_tokens']}/{second['cached_tokens']}/"
              f"{other['cached_tokens']} of {first['prompt_tokens']}; identical {row['identical_text']}", flush=True)
    return rows


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return round(a["ttft_s"] / b["ttft_s"], 4) if a["ttft_s"] and b["ttft_s"] else None


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        xs = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(xs), 4) if xs else None

    def med_ttft(which: str) -> float | None:
        xs = [r[which]["ttft_s"] for r in rows if r[which]["ttft_s"] is not None]
        return round(statistics.median(xs), 4) if xs else None

    return {"prompts": len(rows), "ttft_first_p50_s": med_ttft("first"), "ttft_second_p50_s": med_ttft("second"),
            "ttft_other_p50_s": med_ttft("other_question"), "ratio_second_over_first_p50": med(
                "ratio_second_over_first"), "ratio_other_over_first_p50": med("ratio_other_over_first"),
            "all_identical": all(r["identical_text"] for r in rows),
            "second_cached_tokens": [r["second"]["cached_tokens"] for r in rows]}


def with_server(work: Path, config: Path, cache: bool, prompts: list[int], max_tokens: int) -> dict[str, Any]:
    data = yaml.safe_load(config.read_text())
    for app in data["applications"]:
        app["args"].setdefault("scheduler", {})["enable_prefix_caching"] = cache
    path = work / f"local-cache-{'on' if cache else 'off'}.yaml"
    path.write_text(yaml.safe_dump(data))
    server = tidal_server(work, path)
    server.log = work / f"serve-cache-{'on' if cache else 'off'}.log"
    with server.log.open("w") as log:
        proc = subprocess.Popen(server.cmd, env=server.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            first_answer(server.url, 900, proc)
            rows = run_sequence(server.url, prompts, max_tokens)
        finally:
            stop_server(proc)
    return {"enable_prefix_caching": cache, "rows": rows, "summary": summary(rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/prefix_cache_serve"))
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    p.add_argument("--url", help="measure a server already running here (its own config) instead")
    p.add_argument("--prompts", type=int, default=5, help="different system prompts")
    p.add_argument("--first-prompt", type=int, default=0, help="index of the first system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--uncached", action="store_true", help="also run a server with enable_prefix_caching: false")
    args = p.parse_args(argv)
    prompts = list(range(args.first_prompt, args.first_prompt + args.prompts))
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    if args.url:
        rows = run_sequence(args.url.rstrip("/"), prompts, args.max_tokens)
        runs.append({"url": args.url, "rows": rows, "summary": summary(rows)})
    else:
        for cache in (True, False) if args.uncached else (True,):
            print(f"server with enable_prefix_caching: {str(cache).lower()}", flush=True)
            runs.append(with_server(args.out, args.config, cache, prompts, args.max_tokens))
    for run in runs:
        print(json.dumps(run["summary"]))
    (args.out / "results.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
