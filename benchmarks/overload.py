"""Overload, the long version (issue 8, item 1): configs/sim.yaml at 3x its capacity, adaptive vs continuous.

One Ray cluster of this script's own runs two copies of the simulated A100 unit of configs/sim.yaml:
`/adaptive` as shipped (admission control on) and `/continuous` (the vLLM-like `continuous`
preset: no admission control, unbounded queue). Both get the very same open-loop trace: Poisson
arrivals at `--load` x the unit's capacity (measured by the simulator on the load's lengths:
Azure conversation by default, `--lengths` another shipped trace) for `--duration` seconds, then
one probe request (repeated every 0.2 s while refused).
While the load runs, `/health` and `unit_state(check=True)` are polled every 0.25 s.

Reported per policy: outcomes, client-side latency of the 429s (p50/p99/max; then per admission
rule, with how many of each the unit itself decided and how many were decided before it), SLO attainment of
the admitted requests (TTFT <= 1 s, TPOT <= 100 ms, from the client), `/health` answers, the KV
pool's lowest free count and any integrity failure, how soon a request is served once the
arrivals stop, and where the time goes on a small box: the CPU each process used, and each 429
split by Serve's own access logs into proxy hop, ingress work and the router's `generate` call.
Before the load: the idle latency of `/health` (HTTP -> proxy -> ingress -> router and back), the
fixed cost every answer pays.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/overload.py \
        [--duration 60] [--load 3] [--seed 8] [--lengths mooncake-conv --max-input 7000] [--out runs/overload]

With `--simulate`, the simulator on the very same trace instead (configs/sim.yaml's unit and cost
model; no cluster): what Serve's figures should come close to.

Burst mode (`--burst N:T`, repeatable): configs/sim.yaml as shipped, one app, N chat requests
evenly spaced over T seconds (prompts of 50-450 words, max_tokens 128, streamed), sent with plain
httpx (one attempt each) and/or the official `openai` client with its default retries
(`--client`, repeatable); the unit drained and left idle `--settle` seconds between bursts.
Reported per burst: every request's outcome, the refusals' latency (p50/p99/max, per attempt),
the admitted requests' TTFT against the 1 s target, amplification (HTTP attempts per request),
how the retries arrived (peak per second), where the refusals were decided (the unit's own
count of rejections; the rest at the front gate) and the CPU of each process:

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/overload.py \
        --burst 400:2 --burst 2000:10 --client httpx --client openai --out runs/burst

With `--url`, the bursts go to a server started elsewhere, as a user starts it (`serve run
configs/sim.yaml`): the figures any client sees, without the unit's counts, the CPU or the drain check:

    python benchmarks/overload.py --url http://127.0.0.1:8000 --burst 400:2 --client httpx --out runs/burst-url
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

from loadgen.records import Trace
from tests.integration.reliability.cluster import (
    CpuMeter,
    alive_actors,
    app_from_config,
    machine,
    replica_pids,
    serve_cluster,
    session_dir,
    wait_drained,
)
from tests.integration.reliability.load import (
    Probe,
    load_figures,
    pct,
    poisson_trace,
    run_load,
    sim_capacity_rps,
    sim_unit,
)
from tests.integration.reliability.logs import breakdown

POLICIES = ("adaptive", "continuous")


def idle_health_ms(url: str, n: int = 100) -> dict[str, Any]:
    samples = []
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            samples.append((time.perf_counter() - t0) * 1e3)
    return {"n": n, "p50_ms": pct(samples, 50), "p99_ms": pct(samples, 99), "max_ms": round(max(samples), 3)}


def shared_trace(args: argparse.Namespace) -> Trace:
    """The one open-loop trace every variant gets, on Serve and with `--simulate`."""
    return poisson_trace(args.rate, args.duration, seed=args.seed, max_input=args.max_input, source=args.lengths)


def run_policy(base: str, policy: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One variant (an app named `policy` or `policy-stream<ms>`) on the shared trace."""
    url = f"{base}/{policy}"
    trace = shared_trace(args)
    meter = CpuMeter({"proxy": [a["pid"] for a in alive_actors("ProxyActor")],
                      "ingress": replica_pids(policy, "Ingress"), "router": replica_pids(policy, "ServingUnit")})
    meter.start()
    run = asyncio.run(run_load(url, policy, trace, out / policy, probe=Probe(), drain_timeout_s=args.drain))
    cpu = meter.stop()
    state, drain_s = wait_drained(policy, timeout_s=600.0)
    figures = load_figures(run)
    figures["probe_after_load"] = {k: v for k, v in (run.probe or {}).items() if k != "attempts"}
    return {"policy": policy, **figures, "cpu": cpu, "rejections_server_side": breakdown(session_dir(), policy),
            "drained_after_s": round(drain_s, 1), "final_state": {k: state[k] for k in (
                "num_free_blocks", "num_blocks", "num_requests", "num_streams", "healthy", "finished", "rejected")}}


def simulate(args: argparse.Namespace) -> int:
    """`--simulate`: the simulator on the very trace each policy would get, with configs/sim.yaml's
    unit and cost model (`sim_unit`): what Serve's figures should come close to (no cluster)."""
    from loadgen.report import OK, Slo
    from loadgen.sim.runner import RunSpec
    from loadgen.sim.runner import run_policy as simulate_policy

    cost, base = sim_unit()
    trace = shared_trace(args)
    slo = Slo()
    print("| policy | sent | completed | within the SLO | share |\n|---|---|---|---|---|")
    for pol in args.policy or list(POLICIES):
        o = simulate_policy(RunSpec(trace, base, cost, slo), pol, progress=False).run.outcomes
        done, within = int((o.status == OK).sum()), int(o.meets_slo(slo).sum())
        print(f"| {pol} (simulator) | {len(o.status)} | {done} | {within} | {within / max(1, done):.3f} |")
    return 0


def table(results: list[dict[str, Any]]) -> str:
    cols = ["policy", "sent", "completed", "rejected", "429 p50/p99/max ms", "admitted SLO", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms", "health not 200", "min free KV", "integrity errors", "probe served after s"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        rl, tt, tp = r["rejection_latency"], r["admitted_ttft"], r["admitted_tpot"]
        probe = r["probe_after_load"]
        rows.append("| " + " | ".join(str(x) for x in (
            r["policy"], r["sent"], r["completed"], r["rejected"], f"{rl['p50_ms']} / {rl['p99_ms']} / {rl['max_ms']}",
            r["admitted_slo_attainment"], f"{tt['p50_ms']} / {tt['p99_ms']}", f"{tp['p50_ms']} / {tp['p99_ms']}",
            f"{r['health_not_200']} of {r['health_samples']}", f"{r['min_free_blocks']} of {r['num_blocks']}",
            len(r["unit_state_errors"]), probe.get("served_sent_after_load_s"))) + " |")
    return "\n".join(rows)


def rule_table(results: list[dict[str, Any]]) -> str:
    """The 429s by admission rule (the error body's code), how many of them the unit itself
    decided (its own count; the rest were decided before it: the front gates, the request router)
    and their latency at the client."""
    rows = ["| policy | rule | 429s | decided by the unit | before the unit | p50 / p99 / max ms |",
            "|---|---|---|---|---|---|"]
    for r in results:
        unit = r["final_state"].get("rejected") or {}
        for code, n in r["rejected_by_code"].items():
            lat, own = r["rejection_latency_by_code"][code], int(unit.get(code, 0))
            rows.append(f"| {r['policy']} | {code} | {n} | {own} | {n - own} | "
                        f"{lat['p50_ms']} / {lat['p99_ms']} / {lat['max_ms']} |")
    return "\n".join(rows)


def run_bursts(args: argparse.Namespace) -> int:
    """Burst mode: each (burst, client) pair in turn against one app of configs/sim.yaml as shipped,
    or against the server at `--url` (started by the user, e.g. `serve run configs/sim.yaml`)."""
    from tests.integration.reliability.burst import burst_figures, run_burst
    from tests.integration.reliability.cluster import SIM_MODEL, unit_state

    if args.url:
        return run_bursts_at(args, args.url.rstrip("/"), SIM_MODEL)
    app = "burst"
    report: dict[str, Any] = {"machine_at_start": machine(), "results": []}
    with serve_cluster([app_from_config("sim", app, f"/{app}")]) as base:
        url = f"{base}/{app}"
        report["idle_health"] = idle_health_ms(url)

        def once(spec: Any, client: str) -> tuple[dict[str, Any], dict[str, Any]]:
            before = unit_state(app)
            meter = CpuMeter({"proxy": [a["pid"] for a in alive_actors("ProxyActor")],
                              "ingress": replica_pids(app, "Ingress"), "unit": replica_pids(app, "ServingUnit")})
            meter.start()
            run = asyncio.run(run_burst(url, SIM_MODEL, spec, client))
            cpu = meter.stop()
            state, _ = wait_drained(app, timeout_s=600.0)
            figures = burst_figures(run)
            figures["unit_rejections"] = sum(state["rejected"].values()) - sum(before["rejected"].values())
            figures["regime_before"] = before["regime_name"]
            figures.update(cpu=cpu, load_avg_after=machine()["load_avg_1_5_15"], drained=state["num_requests"] == 0
                           and state["num_free_blocks"] == state["num_blocks"])
            return run, figures

        return each_burst(args, report, once)


def run_bursts_at(args: argparse.Namespace, url: str, model: str) -> int:
    """Burst mode against a server this script did not start: what any client sees (outcomes, the
    refusals' latency and where they were decided, from the responses' headers); the unit's own
    counts, the processes' CPU and the drain check need the cluster, so they are left out. Between
    bursts the server is left idle `--settle` seconds, then must answer `/health`."""
    from tests.integration.reliability.burst import burst_figures, run_burst

    report: dict[str, Any] = {"machine_at_start": machine(), "url": url, "results": []}
    report["idle_health"] = idle_health_ms(url)

    def once(spec: Any, client: str) -> tuple[dict[str, Any], dict[str, Any]]:
        httpx.get(f"{url}/health", timeout=30).raise_for_status()
        run = asyncio.run(run_burst(url, model, spec, client))
        figures = burst_figures(run)
        figures["load_avg_after"] = machine()["load_avg_1_5_15"]
        return run, figures

    return each_burst(args, report, once)


def each_burst(args: argparse.Namespace, report: dict[str, Any],
               once: Callable[[Any, str], tuple[dict[str, Any], dict[str, Any]]]) -> int:
    """Each (`--burst`, `--client`) pair in turn, `--settle` idle seconds before each: `once(spec,
    client)` runs it and returns (the raw run, its figures); each raw run and the report are saved
    under `--out`, the figures printed as they come and the table at the end."""
    from tests.integration.reliability.burst import BurstSpec

    for burst in args.burst:
        n, seconds = burst.split(":")
        for client in args.client or ["httpx"]:
            time.sleep(args.settle)
            run, figures = once(BurstSpec(int(n), float(seconds), seed=args.seed), client)
            report["results"].append(figures)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"burst-{n}-{seconds}-{client}.json").write_text(json.dumps(run))
            print(json.dumps(figures), flush=True)
    report["machine_at_end"] = machine()
    (args.out / "bursts.json").write_text(json.dumps(report, indent=1))
    print(burst_table(report["results"]))
    return 0


def rescore(folder: Path) -> int:
    """The burst figures and table recomputed from the raw runs a burst run saved (burst-*.json)."""
    from tests.integration.reliability.burst import burst_figures

    saved = {r["client"] + str(r["requests"]): r for r in json.loads((folder / "bursts.json").read_text())["results"]}
    results = []
    for path in sorted(folder.glob("burst-*.json"), key=lambda p: (int(p.name.split("-")[1]), p.name)):
        figures = burst_figures(json.loads(path.read_text()))
        old = saved.get(figures["client"] + str(figures["requests"]), {})
        results.append({**old, **figures})
    print(burst_table(results))
    return 0


def burst_table(results: list[dict[str, Any]]) -> str:
    cols = ["burst", "client", "outcomes", "attempts (x)", "429/503 ms p50 / p99 / max", "refused by",
            "admitted TTFT ms p50 / p99 (<= 1 s)", "first token from 1st attempt ms p50 / p99", "retries: peak per s",
            "Retry-After s min / p50 / max"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        rl, tt, ra = r["refusal_ms"], r["admitted_ttft_ms"], r["retry_after_s"]
        rows.append("| " + " | ".join(str(x) for x in (
            f"{r['requests']} in {r['burst_s']:g} s", r["client"],
            ", ".join(f"{k}: {v}" for k, v in r["outcomes"].items()),
            f"{r['http_attempts']} ({r['amplification']})", f"{rl['p50']} / {rl['p99']} / {rl['max']}",
            ", ".join(f"{k} {v}" for k, v in r["refused_by"].items()),
            f"{tt['p50']} / {tt['p99']} ({tt['share_within_target']})",
            "{p50} / {p99}".format(**r["first_token_from_first_attempt_ms"]),
            r["retries"]["peak_per_s"], f"{ra['min']} / {ra['p50']} / {ra['max']}")) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--load", type=float, default=3.0, help="offered rate as a multiple of the unit's capacity")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--lengths", default="azure-conv", choices=("azure-conv", "azure-code", "mooncake-conv"),
                   help="the trace the prompt and output lengths are drawn from (the capacity is measured on them)")
    p.add_argument("--max-input", type=int, default=6000, help="prompt tokens are clipped to this")
    p.add_argument("--simulate", action="store_true",
                   help="the simulator on the same trace instead of Serve (what Serve should come close to)")
    p.add_argument("--drain", type=float, default=300.0, help="seconds in-flight requests may take after the load")
    p.add_argument("--policy", action="append", choices=POLICIES, help="default: both")
    p.add_argument("--stream-interval", action="append", type=float, metavar="S",
                   help="args.streaming.interval_s of the units (repeat to compare; each policy runs with "
                        "each; default: the config's)")
    p.add_argument("--min-streams", type=int, default=None, help="args.streaming.min_streams (default: the config's)")
    p.add_argument("--out", type=Path, default=Path("runs/overload"))
    p.add_argument("--burst", action="append", metavar="N:T", help="burst mode: N requests in T seconds (repeat)")
    p.add_argument("--client", action="append", choices=("httpx", "openai"), help="burst mode's client(s)")
    p.add_argument("--settle", type=float, default=20.0, help="burst mode: idle seconds before each burst")
    p.add_argument("--rescore", type=Path, metavar="DIR", help="burst mode: the table again from DIR's raw runs")
    p.add_argument("--url", help="burst mode: a running server's base URL (serving configs/sim.yaml's model) "
                                 "instead of a cluster of this script's own")
    args = p.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    if args.burst:
        return run_bursts(args)
    capacity = sim_capacity_rps(max_input=args.max_input, source=args.lengths)
    args.rate = args.load * capacity
    if args.simulate:
        return simulate(args)
    variants = [(pol, interval) for pol in args.policy or list(POLICIES)
                for interval in (args.stream_interval or [None])]
    policies, apps = [], []
    for pol, interval in variants:
        name = pol if interval is None else f"{pol}-stream{round(interval * 1000)}ms"
        streaming = {k: v for k, v in (("interval_s", interval), ("min_streams", args.min_streams)) if v is not None}
        policies.append(name)
        apps.append(app_from_config("sim", name, f"/{name}", streaming=streaming, policy=pol))
    report: dict[str, Any] = {"machine_at_start": machine(), "capacity_rps": round(capacity, 3),
                              "rate_rps": round(args.rate, 3), "duration_s": args.duration, "seed": args.seed,
                              "lengths": args.lengths, "max_input": args.max_input}
    with serve_cluster(apps) as base:
        report["idle_health"] = {pol: idle_health_ms(f"{base}/{pol}") for pol in policies}
        results = [run_policy(base, pol, args, args.out) for pol in policies]
    report["results"] = results
    report["machine_at_end"] = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overload.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    for r in results:
        print(r["policy"], "cpu:", json.dumps(r["cpu"]), "probe:", json.dumps(r["probe_after_load"]))
        print(r["policy"], "429s server side:", json.dumps(r["rejections_server_side"]))
    print(table(results))
    print(rule_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
