"""`tidal replay`, `tidal compare`, and (from loadgen.sim.cli) `tidal simulate` and `tidal study`.

Owns: the argument parsing of replay and compare and `register(subparsers)`, which `tidal_cli`
calls. The heavy modules (httpx, matplotlib, the replay driver) load only when a command runs,
so `tidal --help` stays fast. Must not import serve_app or actors; loadgen.sim.cli (which loads
tidal_core) is imported only inside `register`.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from loadgen.report import Slo

TRACE_CHOICES = "day-in-life|day-in-life-sharp|azure-code|azure-conv|mooncake-conv|PATH"
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '1.5h' -> seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r}: use seconds or a number with s, m or h (e.g. 15m)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def register(sub: Any) -> None:
    from loadgen.sim import cli as sim_cli  # here, not at the top: it loads tidal_core
    from loadgen.sim import sweep_cli

    _register_replay(sub)
    _register_compare(sub)
    sim_cli.register(sub)
    sweep_cli.register(sub)


def _register_replay(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a trace open loop against an OpenAI-compatible server",
                       description="Open-loop replay: requests go out at their scheduled times whatever the server "
                                   "does; send drift is measured and reported. See docs/load-testing.md.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, help=TRACE_CHOICES)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times (0.01 plays 100x faster)")
    p.add_argument("--rate-scale", type=float, help="thin (<1) or replicate (>1) requests, keeping the shape")
    p.add_argument("--duration", type=parse_duration, help="send only the first D wall seconds (90, 15m, 1h)")
    p.add_argument("--hours", type=float, help="hours of the trace before compression (cut / synthetic day length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input", type=int, help="clip input tokens (the model's context)")
    p.add_argument("--max-output", type=int, help="clip output tokens")
    p.add_argument("--peak-rps", type=float, help="synthetic days: peak rate before compression (default 20)")
    p.add_argument("--cv", type=float, help="synthetic days: inter-arrival CV (default 1.1)")
    p.add_argument("--model", help="model name sent to the server (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--words-per-token", type=float, default=None,
                   help="prompt sizing; default 0.867, measured with SmolLM2's tokenizer")
    p.add_argument("--no-prefix-prompts", action="store_true",
                   help="a trace with prefix ids (Mooncake's hash_ids): unrelated prompts instead of prompts that "
                        "share what the trace's share (the default, so a server's prefix cache hits as recorded)")
    p.add_argument("--slo-ttft", type=float, default=Slo().ttft_s, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, default=Slo().tpot_s, help="TPOT target, seconds")
    p.add_argument("--name", default="replay", help="run name: the key in summary.json")
    p.add_argument("--drain-timeout", type=parse_duration, default=120.0,
                   help="after the last send, wait this long for in-flight requests (default 120 s)")
    p.add_argument("--max-connections", type=int, default=None, help="cap the HTTP pool (default: no cap)")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs behind the server, for gpu_hours")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--retries", type=int, default=2,
                   help="retry a 429/5xx as the openai client does: this many times (its default 2), waiting the "
                        "server's Retry-After, else 0.5 s x 2^n backoff; 0 sends each request once")
    p.set_defaults(func=run_replay)


def _register_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="compare replay and simulation run directories side by side",
                       description="A markdown table of every summary in every directory, and overlaid plots.")
    p.add_argument("dirs", nargs="+", help="directories written by tidal replay or tidal simulate")
    p.add_argument("--out", default="compare", help="where compare.md and the plots go (default ./compare)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=run_compare)


def _load(args: argparse.Namespace) -> Any:
    from loadgen.traces import load_trace

    kw = {"time_scale": args.time_scale, "rate_scale": args.rate_scale, "max_input": args.max_input,
          "max_output": args.max_output, "peak_rps": args.peak_rps, "cv": args.cv}
    return load_trace(args.trace, hours=args.hours, seed=args.seed, **{k: v for k, v in kw.items() if v is not None})


def run_replay(args: argparse.Namespace) -> int:
    import asyncio

    from loadgen.client import DEFAULT_WORDS_PER_TOKEN, ClientConfig, discover_model, make_http_client
    from loadgen.replay import ReplayConfig, replay
    from loadgen.report import markdown_table
    from loadgen.retry_policy import RetryPolicy

    try:
        trace = _load(args)
        if args.duration is not None and args.duration < trace.duration_s:
            trace = trace.window(0.0, args.duration)
        model = args.model
        if model is None:
            async def ask() -> str | None:
                probe = ClientConfig(args.url, api_key=args.api_key)
                async with make_http_client(probe) as client:
                    return await discover_model(client, args.url)
            model = asyncio.run(ask()) or "default"
        client = ClientConfig(args.url, model=model, endpoint=args.endpoint, seed=args.seed,
                              words_per_token=args.words_per_token or DEFAULT_WORDS_PER_TOKEN,
                              max_connections=args.max_connections, api_key=args.api_key,
                              prefix_prompts=not args.no_prefix_prompts)
        config = ReplayConfig(run_name=args.name, time_scale=args.time_scale, duration_s=args.duration,
                              drain_timeout_s=args.drain_timeout, slo=Slo(args.slo_ttft, args.slo_tpot),
                              gpus=args.gpus, progress=not args.no_progress, plots=not args.no_plots,
                              retries=RetryPolicy(max_retries=args.retries) if args.retries > 0 else None)
    except (TypeError, ValueError, KeyError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"replaying {trace.name}: {len(trace)} requests over {trace.duration_s:.1f} s to {client.url} "
          f"(model {model!r})", file=sys.stderr)
    try:
        report = replay(trace, client, config, args.out)
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = report.summary
    cols = ("arrived", "completed", "rejected", "errors", "incomplete", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms",
            "e2e_p99_ms", "goodput_rps", "slo_attainment")
    print(markdown_table([s], cols))
    d = s["drift"]
    print(f"send drift (on the wire minus scheduled): p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, "
          f"max {d['max_ms']} ms; {d['over_50ms']} requests over 50 ms")
    r = s.get("retries")
    if r:
        print(f"retries: {r['retries_sent']} sent ({r['retries_admitted']} admitted), load amplification "
              f"{r['amplification']}, goodput as the user waited (from the first send) {s['client_goodput_rps']} rps")
    c = s.get("prefix_cache")
    if c:
        shared = trace.prefix_ids is not None and client.prefix_prompts
        shared_note = " (prompts share the trace's prefixes)" if shared else ""
        print(f"prefix cache: {c['hit_rate']:.1%} of the completed requests' prompt tokens cached{shared_note}, "
              f"{c['requests_with_hits']} of {c['requests']} requests with a hit")
    print(f"results in {report.out_dir}/ (requests.jsonl, summary.json, per_hour.json, plots)")
    return 130 if report.interrupted else 0


def run_compare(args: argparse.Namespace) -> int:
    from loadgen.compare import compare

    try:
        text = compare(args.dirs, args.out, plot=not args.no_plots)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
