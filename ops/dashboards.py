"""The tidalserve Grafana dashboard, generated from serve_app/metric_defs.py and the config's SLO.

Owns: `serving_dashboard(targets)` (one dashboard, eight rows: traffic and regime, latency
against the SLO, batching, KV cache (and its prefix-cache hit rate) and queue, admission and
failures, the batch class, units and autoscaling, API keys)
and `all_dashboards`. Every series name comes from a `MetricDef` (through ops/promql.py)
or from promql's list of Ray Serve metrics; every threshold line from `Targets` (the config).
docs/operations.md describes each panel. Must not import ray.
"""

from __future__ import annotations

from typing import Any

from ops import alerts as A
from ops import promql as Q
from ops.grafana_panels import Panel, Target, dashboard, datasource_variable, query_variable
from ops.grafana_panels import stat as stat_panel
from ops.grafana_panels import state_timeline as timeline
from ops.grafana_panels import timeseries as ts
from ops.targets import Targets
from serve_app import metric_defs as M

SERVING_UID = "tidalserve-serving"
REGIME_STATES = {0: ("LIGHT", "green"), 1: ("STEADY", "blue"), 2: ("OVERLOAD", "red")}
UNIT_LEGEND = "{{unit}}"


def _quantiles(defn: M.MetricDef, label: str) -> list[Target]:
    return [Target(Q.quantile(defn, 0.5), f"{label} p50"), Target(Q.quantile(defn, 0.99), f"{label} p99")]


def _traffic(t: Targets) -> list[Panel]:
    return [
        ts("Requests per second", "Arrivals at the units, completions by finish reason, and refusals (by the "
           "units' admission or at the front door, before reaching a unit).",
           [Target(Q.counter_rate(M.ARRIVALS), "arrived"),
            Target(Q.counter_rate(M.FINISHED, group=("reason",)), "finished {{reason}}"),
            Target(Q.refusals_rate(), "refused")], "reqps", width=8),
        timeline("Regime by unit", "Each unit's traffic regime (LIGHT / STEADY / OVERLOAD), as its scheduler "
                 "calls it (docs/scheduler.md).", [Target(Q.gauge(M.REGIME), UNIT_LEGEND)], REGIME_STATES, width=8),
        ts("Load by unit", "Utilisation: arrival rate over the unit's measured capacity (1 = at capacity). Dashed: "
           "the LIGHT and OVERLOAD entry marks.", [Target(Q.gauge(M.LOAD), UNIT_LEGEND)], "percentunit",
           lines=(t.light_load, t.overload_load), width=8),
        ts("Capacity and demand", "Sum of the units' measured capacity against the arrival rate.",
           [Target(Q.gauge(M.CAPACITY, op="sum", group=()), "capacity"),
            Target(Q.counter_rate(M.ARRIVALS), "arrivals")], "reqps", width=12),
        ts("Tokens per second", "Prompt tokens admitted and tokens generated.",
           [Target(Q.counter_rate(M.PROMPT_TOKENS), "prompt"),
            Target(Q.counter_rate(M.GENERATION_TOKENS), "generated")], "short", width=12),
    ]


def _latency(t: Targets) -> list[Panel]:
    tpot_lines = (t.tpot_s,) if t.tpot_s else ()
    within = Q.fraction_within(M.TTFT, t.ttft_s, window="$__range", match=Q.UNIT_FILTER)
    return [
        ts("Time to first token", f"p50 and p99 of TTFT (arrival to first token). Dashed: the {t.ttft_s:g} s "
           "target (args.scheduler.admission.target_ttft_s).", _quantiles(M.TTFT, "TTFT"), "s",
           lines=(t.ttft_s,)),
        ts("Inter-token latency", "p50 and p99 of the gap between output tokens, and the largest unit's "
           "measured recent TPOT (what the autoscaler reads: a unit near the target asks for one more). "
           "Dashed: the TPOT target (admission.target_tpot_s).",
           [*_quantiles(M.ITL, "ITL"), Target(Q.gauge(M.MEASURED_TPOT, group=()), "measured TPOT (max unit)")],
           "s", lines=tpot_lines),
        ts("End-to-end latency", "p50 and p99 from arrival to the last token, completed requests.",
           _quantiles(M.E2E, "E2E"), "s", width=8),
        ts("Queue time and predicted delay", "p50/p99 of arrival-to-admission, the largest predicted "
           "queueing delay of a new arrival, and the limit admission control compares a prediction with "
           "(the TTFT target times the regime's burst factor and the learned admission aim).",
           [*_quantiles(M.QUEUE_TIME, "queue"),
            Target(Q.gauge(M.QUEUE_DELAY, group=()), "predicted delay (max unit)"),
            Target(Q.gauge(M.ADMISSION_LIMIT, group=()), "admission limit (max unit)"),
            Target(Q.quantile(M.FRONT_DELAY, 0.99, match=""), "proxy to ingress p99")], "s",
           lines=(t.ttft_s,), width=8),
        stat_panel("Requests within the TTFT target", f"Fraction of requests whose first token came within "
                   f"{t.ttft_s:g} s over the dashboard's time range; the SLO is {t.ttft_objective:.0%}.",
                   [Target(within, "within target")], "percentunit", good_above=t.ttft_objective, width=4),
        ts("TTFT error-budget burn rate", "What the burn-rate alerts evaluate (all units): 1 spends the error "
           "budget exactly; dashed: the slow (6x) and fast (14.4x) paging marks.",
           [Target(A.ttft_burn_rate(t, w), f"burn {w}") for w in ("5m", "1h")], "short",
           lines=(A.SLOW_BURN[1], A.FAST_BURN[1]), width=4),
    ]


def _batching(t: Targets) -> list[Panel]:
    return [
        ts("Micro-wait", "p50/p99 of the wait the batching policy chose before a step (0 when none). Dashed: the "
           "5 ms hard cap.", _quantiles(M.MICROWAIT, "wait"), "s", lines=(t.microwait_cap_s,), width=8),
        ts("Batch size", "p50/p99 and mean of sequences per engine step.",
           [*_quantiles(M.BATCH_SIZE, "batch"), Target(Q.hist_mean(M.BATCH_SIZE), "mean")], "short", width=8),
        ts("Dispatches by reason", "Engine steps per second by why they launched (full, budget, "
           "microwait_expired, join, immediate, ...).",
           [Target(Q.counter_rate(M.DISPATCHES, group=("reason",)), "{{reason}}")], "ops", width=8),
        ts("CUDA-graph padding waste", "Fraction of captured-batch slots that were padding, per unit, since "
           "start.", [Target(Q.gauge(M.PADDING_WASTE), UNIT_LEGEND)], "percentunit"),
        ts("Step device time", "p50/p99 of one engine step's device time.", _quantiles(M.STEP_TIME, "step"), "s"),
        ts("TTFT prediction error", "p50/p99 of predicted over measured time to first token of admitted "
           "requests (what admission control acted on). Dashed: 1, an exact prediction.",
           _quantiles(M.TTFT_PREDICTION, "predicted/measured"), "short", lines=(1.0,)),
        ts("Step sizer: TPOT aim by unit", "The mean time between tokens each step is sized for, learned from "
           "finished requests' TPOT (about 1% come within 2% of the target). Dashed: the TPOT target.",
           [Target(Q.gauge(M.TPOT_AIM), UNIT_LEGEND)], "s", lines=(t.tpot_s,) if t.tpot_s else ()),
        ts("Step sizer: borrow scale by unit", "The share of its borrow quantiles the step sizer lends against "
           "(1: as configured). Each request that missed the TPOT target lowers it, each other raises it a "
           "little: low when short answers borrowed and ended before repaying.",
           [Target(Q.gauge(M.BORROW_SCALE), UNIT_LEGEND)], "short"),
        ts("Step sizer: OVERLOAD prefill cap by unit", "Prompt tokens a step may hold in OVERLOAD, learned down "
           "while the batch sits at max_batch_size with prompts waiting (the queue forms in slots, which admission "
           "cannot tell a long prompt from a short one by) and back up when the cap cuts prompts with a slot "
           "free. At max_num_batched_tokens: never lowered (the TPOT target binds first on most units).",
           [Target(Q.gauge(M.OVERLOAD_PREFILL_CAP), UNIT_LEGEND)], "short", width=24),
    ]


def _kv_queue(t: Targets) -> list[Panel]:
    return [
        ts("KV-cache usage by unit", "Fraction of KV blocks in use. Dashed: the OVERLOAD KV mark (alert) and "
           "the KV rejection mark.", [Target(Q.gauge(M.KV_USAGE), UNIT_LEGEND)], "percentunit",
           lines=(t.kv_alert, t.kv_reject), width=8),
        ts("Running requests by unit", "Requests in the running batch (prefilling or decoding).",
           [Target(Q.gauge(M.RUNNING), UNIT_LEGEND)], "short", width=8),
        ts("Waiting requests by unit", "Requests queued for admission.",
           [Target(Q.gauge(M.WAITING), UNIT_LEGEND)], "short", width=8),
        ts("Prefix-cache hit rate", "Share of the prompt tokens looked up at admission whose KV the prefix cache "
           "held (tokens), and share of admissions with any cached block (requests).",
           [Target(_ratio(M.PREFIX_HIT_TOKENS, M.PREFIX_QUERIED_TOKENS), "tokens"),
            Target(_ratio(M.PREFIX_HIT_REQUESTS, M.PREFIX_QUERIED_REQUESTS), "requests")], "percentunit",
           width=12),
        ts("Prefix-cache tokens", "Prompt tokens per second looked up in the prefix cache and found there "
           "(found tokens are not computed).",
           [Target(Q.counter_rate(M.PREFIX_QUERIED_TOKENS), "queried"),
            Target(Q.counter_rate(M.PREFIX_HIT_TOKENS), "hit")], "short", width=12),
    ]


def _ratio(hit: M.MetricDef, queried: M.MetricDef) -> str:
    return f"{Q.counter_rate(hit)} / {Q.counter_rate(queried)}"


def _admission(t: Targets) -> list[Panel]:
    return [
        ts("Rejections by reason", "Requests turned away per second (HTTP 429, or 400 for too_long), by where it "
           "was decided (a unit's admission, or the front door: the proxy's or an ingress's gate) and reason. "
           "Front-door refusals belong to no unit: they show whichever units are selected.",
           [Target(Q.refusals_by_where(), "{{where}} {{reason}}")], "reqps", width=6),
        ts("Front door's aim", "Share of a unit's TTFT limit each front gate (the proxy's, an ingress's) lets its "
           "predicted TTFT reach before refusing at the door: 1 while its predictions hold; lowered by each "
           "request it let through that a gate or unit behind it refused for its backlog (prefill_backlog there).",
           [Target(Q.gauge(M.FRONT_AIM, op="min", group=(M.WHERE_TAG, M.APP_TAG), match=""),
                   "{{where}} {{application}}")], "percentunit", width=6),
        ts("Rejected fraction", "Refusals (too_long excluded; by the units and at the front door) over requests "
           "offered (arrivals at the units plus front-door refusals). Dashed: the alert mark.",
           [Target(Q.refused_fraction(), "rejected")], "percentunit",
           lines=(t.rejection_ratio,), width=6),
        ts("Preemptions by reason", "Running requests preempted (recompute) per second, by service class and "
           "reason: kv_exhausted, or batch_yield (a batch request gave its slot or KV to interactive ones).",
           [Target(Q.counter_rate(M.PREEMPTIONS, group=(M.CLASS_TAG, "reason")), "{{class}} {{reason}}")], "ops",
           width=6),
        ts("Engine errors by kind", "Engine failures (dead TP worker, step timeout) per second.",
           [Target(Q.counter_rate(M.ENGINE_ERRORS, group=("unit", "kind")), "{{unit}} {{kind}}")], "ops",
           width=6),
        ts("Slow-prompt ratio by unit", "What long prompts admitted with nothing ahead took to their first token "
           "over the step model's lower bound (learned median; 1: the bound itself). In OVERLOAD a prompt whose "
           "bound times this passes the TTFT target is refused (prompt_over_target, in Rejections by reason).",
           [Target(Q.gauge(M.SLOW_PROMPT_RATIO), UNIT_LEGEND)], "short", width=6),
        ts("Costly-prompt limit by unit", "While a unit is over capacity it serves the cheapest requests that fit "
           "it: the longest prompt (tokens not in its prefix cache) it serves now; longer ones are refused "
           "(costly_prompt, in Rejections by reason). 0: no limit.",
           [Target(Q.gauge(M.COSTLY_LIMIT), UNIT_LEGEND)], "short", width=6),
    ]


def _batch_class() -> list[Panel]:
    return [
        ts("Batch backlog", "Batch-class requests (service_tier=flex) waiting for headroom, and running, summed "
           "over the selected units. A backlog that shrinks through the night is the trough being filled.",
           [Target(Q.gauge(M.BATCH_WAITING, op="sum", group=()), "waiting"),
            Target(Q.gauge(M.BATCH_RUNNING, op="sum", group=()), "running")], "short", width=8),
        ts("Batch backlog tokens by unit", "Prompt tokens of the batch class still to compute (queued or "
           "mid-prefill); over the batch tokens/s, how long the backlog takes to drain.",
           [Target(Q.gauge(M.BATCH_BACKLOG_TOKENS), UNIT_LEGEND)], "short", width=8),
        ts("Batch tokens per second", "Tokens the batch class computed per second: prompt (with recomputation "
           "after a preemption) and generated. Near zero while interactive traffic uses the headroom.",
           [Target(Q.counter_rate(M.BATCH_TOKENS, group=("kind",)), "{{kind}}")], "short", width=8),
    ]


def _units() -> list[Panel]:
    router = f'deployment="{Q.SERVE_DEPLOYMENT}"'
    healthy = Q.selector(Q.SERVE_REPLICA_HEALTHY, router, 'replica=~"$unit"')
    return [
        ts("Units and autoscaling", "Units reporting metrics; what the tidalserve autoscaling policy asks for "
           "(desired) and its raw demand; Serve's target and healthy ServingUnit replicas.",
           [Target(A.units_reporting(), "reporting"),
            Target(Q.gauge(M.UNITS_DESIRED, group=(), match=""), "desired (policy)"),
            Target(Q.gauge(M.UNITS_DEMAND, group=(), match=""), "demand (policy)"),
            Target(A.serve_router_target(), "target (Serve)"),
            Target(A.serve_router_healthy(), "healthy (Serve)")], "short"),
        ts("ServingUnit replica health", "Serve's health of each ServingUnit replica (1 healthy, 0 unhealthy or "
           "stopped); the replica id is the unit id.", [Target(f"max by (application, replica) ({healthy})",
                                                                "{{application}} {{replica}}")], "short"),
    ]


def _api_keys() -> list[Panel]:
    return [
        ts("Requests by API key", "Requests with a valid key at the ingress, by key id and outcome (admitted, or "
           "rate_limited: 429 rate_limit_exceeded for the key's RPM/TPM).",
           [Target(Q.counter_rate(M.API_REQUESTS, group=(M.KEY_TAG, "outcome"), match=""), "{{key}} {{outcome}}")],
           "reqps", width=8),
        ts("Tokens by API key", "Prompt and generated tokens per second by key id (what TPM limits count).",
           [Target(Q.counter_rate(M.API_TOKENS, group=(M.KEY_TAG, "kind"), match=""), "{{key}} {{kind}}")],
           "short", width=8),
        ts("Refused with 401", "Requests without a valid API key per second (missing, malformed or unknown).",
           [Target(Q.counter_rate(M.AUTH_FAILURES, match=""), "401")], "reqps", width=8),
    ]


def serving_dashboard(t: Targets) -> dict[str, Any]:
    variables = [datasource_variable(),
                 query_variable("unit", "Unit", M.REGIME.prom_name, M.UNIT_TAG)]
    sections = [("Traffic and regime", _traffic(t)), ("Latency against the SLO", _latency(t)),
                ("Batching", _batching(t)), ("KV cache and queue", _kv_queue(t)),
                ("Admission and failures", _admission(t)), ("Batch class", _batch_class()),
                ("Units and autoscaling", _units()),
                ("API keys", _api_keys())]
    return dashboard(SERVING_UID, "tidalserve / serving",
                     "tidalserve serving units: traffic, regimes, latency against the SLO, batching, KV cache, "
                     "admission and autoscaling. Generated by `tidal dashboards render`; see docs/operations.md.",
                     variables, sections, ["tidalserve", "llm", "ray-serve"])


def all_dashboards(t: Targets) -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON."""
    return {f"{SERVING_UID}.json": serving_dashboard(t)}
