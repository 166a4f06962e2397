"""Every metric tidalserve exports: the one source of truth for names, types, labels, buckets.

serve_app/metrics.py creates `ray.util.metrics` objects from these definitions; the Grafana
dashboards and Prometheus alert rules (ops/) build their PromQL from them, so a name
is never typed twice. Ray exports a metric named `tidal_x` to Prometheus as `ray_tidal_x`
(counters gain `_total`; histograms `_bucket`, `_sum`, `_count`): `prom_name` gives that.

No imports beyond the standard library: dashboards are generated without Ray installed.
"""

from __future__ import annotations

from dataclasses import dataclass

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                     3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 1.0, 2.0)
WAIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)

UNIT_TAG = "unit"
"""Every metric carries the serving unit (router replica) it came from."""


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tag_keys: tuple[str, ...] = (UNIT_TAG,)
    boundaries: tuple[float, ...] = ()

    @property
    def prom_name(self) -> str:
        base = f"ray_{self.name}"
        return f"{base}_total" if self.kind == "counter" else base

    @property
    def prom_bucket(self) -> str:
        if self.kind != "histogram":
            raise ValueError(f"{self.name} is a {self.kind}, not a histogram")
        return f"ray_{self.name}_bucket"


def _h(name: str, description: str, boundaries: tuple[float, ...], tags: tuple[str, ...] = (UNIT_TAG,)) -> MetricDef:
    return MetricDef(name, "histogram", description, tags, boundaries)


TTFT = _h("tidal_ttft_seconds",
          "Time to first token: arrival at the front end (the proxy's stamp, else the ingress) to the first "
          "token out of the unit",
          LATENCY_BUCKETS_S)
ITL = _h("tidal_inter_token_latency_seconds", "Time between consecutive output tokens of a request", ITL_BUCKETS_S)
E2E = _h("tidal_e2e_latency_seconds", "Arrival at the front end to the last token, for requests that completed",
         LATENCY_BUCKETS_S)
QUEUE_TIME = _h("tidal_queue_time_seconds", "Arrival at the front end to admission into a running batch",
                LATENCY_BUCKETS_S)
MICROWAIT = _h("tidal_microwait_seconds", "Wait chosen by the batching policy before a step (0 = none)",
               WAIT_BUCKETS_S)
BATCH_SIZE = _h("tidal_batch_size", "Sequences in an engine step", BATCH_BUCKETS)
TTFT_PREDICTION = _h("tidal_ttft_prediction_ratio",
                     "Predicted over measured time to first token of admitted requests (1 = exact; below 1 the "
                     "predictor was optimistic)", RATIO_BUCKETS)
FRONT_DELAY = _h("tidal_front_delay_seconds",
                 "Time from the proxy's arrival stamp to an Ingress replica receiving the request (stamped "
                 "requests only): queueing in the proxy and on the way to the replica", LATENCY_BUCKETS_S, ())
STEP_TIME = _h("tidal_step_device_seconds", "Device time of one engine step", ITL_BUCKETS_S)

RUNNING = MetricDef("tidal_num_running", "gauge", "Requests in the running batch (prefilling or decoding)")
WAITING = MetricDef("tidal_num_waiting", "gauge", "Requests queued for admission")
KV_USAGE = MetricDef("tidal_kv_cache_usage", "gauge", "Fraction of KV-cache blocks in use (0..1)")
REGIME = MetricDef("tidal_regime", "gauge", "Traffic regime: 0 light, 1 steady, 2 overload")
LOAD = MetricDef("tidal_load", "gauge",
                 "Utilisation estimate: arrival rate (the front gates' refusals included) over measured capacity")
CAPACITY = MetricDef("tidal_capacity_rps", "gauge", "Measured service capacity of the unit, requests/s")
QUEUE_DELAY = MetricDef("tidal_predicted_queue_delay_seconds", "gauge",
                        "Predicted queueing delay of a new arrival (prefill backlog drain time)")
ADMISSION_LIMIT = MetricDef("tidal_admission_ttft_limit_seconds", "gauge",
                            "Predicted TTFT past which the unit refuses a request with work ahead: the regime's "
                            "limit times the learned admission aim (0: never refuses for TTFT)")
SLOW_PROMPT_RATIO = MetricDef("tidal_admission_slow_prompt_ratio", "gauge",
                              "Learned quantile (the median by default) of measured TTFT over its bound (the prefill "
                              "alone beside the running decodes, in the chunks the step sizer gives it where it holds "
                              "a TPOT target) for long prompts admitted with "
                              "nothing ahead; in overload a prompt whose bound times this passes the TTFT target is "
                              "refused (prompt_over_target)")
COSTLY_LIMIT = MetricDef("tidal_admission_costly_limit_tokens", "gauge",
                         "Longest uncached prompt the unit serves while over capacity, the cheapest requests "
                         "first; longer ones are refused (costly_prompt). 0: no limit (at or below capacity)")
MEASURED_TPOT = MetricDef("tidal_measured_tpot_seconds", "gauge",
                          "Recent mean time per output token the unit measured (0: no decodes lately); the "
                          "autoscaler's hot-unit signal")
TPOT_AIM = MetricDef("tidal_step_sizer_tpot_aim_seconds", "gauge",
                     "Mean time between tokens the step sizer aims each step at, learned from finished requests' "
                     "TPOT so that about 1% come within 2% of the target (0: no TPOT target)")
BORROW_SCALE = MetricDef("tidal_step_sizer_borrow_scale", "gauge",
                         "Share of its configured borrow quantiles the step sizer lends against (1: as configured; "
                         "lowered by each request that missed the TPOT target, so about 0.5% miss)")
OVERLOAD_PREFILL_CAP = MetricDef("tidal_step_sizer_overload_prefill_cap_tokens", "gauge",
                                 "Prompt tokens a step may hold while the unit is in OVERLOAD, learned so that its "
                                 "batch seldom sits at max_batch_size with prompts waiting "
                                 "(max_num_batched_tokens: not lowered)")
PADDING_WASTE = MetricDef("tidal_cuda_graph_padding_waste", "gauge",
                          "Fraction of CUDA-graph batch slots that were padding, since start")
BATCH_WAITING = MetricDef("tidal_batch_backlog_requests", "gauge",
                          "Batch-class requests waiting for headroom (queued, not yet running)")
BATCH_BACKLOG_TOKENS = MetricDef("tidal_batch_backlog_tokens", "gauge",
                                 "Prompt tokens of the batch class still to compute (queued or mid-prefill)")
BATCH_RUNNING = MetricDef("tidal_batch_running", "gauge", "Batch-class requests in the running batch")
UNITS_DESIRED = MetricDef("tidal_autoscale_desired_units", "gauge", "Units the autoscaling policy asks for",
                          ("deployment",))
UNITS_DEMAND = MetricDef("tidal_autoscale_demand_units", "gauge",
                         "Raw demand in units (arrival rate over target-load capacity)", ("deployment",))

DISPATCHES = MetricDef("tidal_dispatches", "counter", "Engine steps launched, by batching reason",
                       (UNIT_TAG, "reason"))
REJECTIONS = MetricDef("tidal_rejections", "counter", "Requests turned away by admission control, by reason",
                       (UNIT_TAG, "reason"))
WHERE_TAG = "where"
"""Where a front-door refusal was decided: `proxy` (Serve's HTTP proxy) or `ingress` (an Ingress replica)."""
FRONT_REFUSALS = MetricDef("tidal_front_refusals", "counter",
                           "Requests refused with 429 at the front door (the proxy's or an ingress's gate) before "
                           "reaching a unit, by where and reason", (WHERE_TAG, "reason"))
APP_TAG = "application"
"""The Serve application a front gate admits for (one proxy fronts every application)."""
FRONT_AIM = MetricDef("tidal_front_aim", "gauge",
                      "Share of a unit's TTFT limit a front gate lets its predicted TTFT reach, learned from the "
                      "requests it let through that were refused behind it (1: its predictions hold)",
                      (WHERE_TAG, APP_TAG))
CLASS_TAG = "class"
"""The service class of a request (tidal_core/service_class.py): interactive or batch."""
PREEMPTIONS = MetricDef("tidal_preemptions", "counter",
                        "Running requests preempted (recompute), by reason and service class",
                        (UNIT_TAG, "reason", CLASS_TAG))
FINISHED = MetricDef("tidal_requests_finished", "counter", "Requests ended, by finish reason",
                     (UNIT_TAG, "reason"))
PROMPT_TOKENS = MetricDef("tidal_prompt_tokens", "counter", "Prompt tokens of admitted requests")
GENERATION_TOKENS = MetricDef("tidal_generation_tokens", "counter", "Tokens generated")
ARRIVALS = MetricDef("tidal_requests_arrived", "counter", "Requests that reached a router")
BATCH_TOKENS = MetricDef("tidal_batch_tokens", "counter",
                         "Tokens the batch class computed, by kind (prompt: including recomputation after a "
                         "preemption; generation: tokens generated)", (UNIT_TAG, "kind"))
ENGINE_ERRORS = MetricDef("tidal_engine_errors", "counter", "Engine failures (dead workers), by kind",
                          (UNIT_TAG, "kind"))
# Prefix cache: hit rate = rate(hit) / rate(queried), in tokens and in requests. A lookup happens
# at each admission (again after a preemption); the counters are the scheduler's own.
PREFIX_QUERIED_TOKENS = MetricDef("tidal_prefix_cache_queried_tokens", "counter",
                                  "Prompt tokens looked up in the prefix cache at admission")
PREFIX_HIT_TOKENS = MetricDef("tidal_prefix_cache_hit_tokens", "counter",
                              "Prompt tokens found in the prefix cache at admission (KV reused, not computed)")
PREFIX_QUERIED_REQUESTS = MetricDef("tidal_prefix_cache_queried_requests", "counter",
                                    "Admissions that looked their prompt up in the prefix cache")
PREFIX_HIT_REQUESTS = MetricDef("tidal_prefix_cache_hit_requests", "counter",
                                "Admissions that found at least one prompt block in the prefix cache")

KEY_TAG = "key"
"""API-key usage is labelled by key id (`key-` + a SHA-256 prefix), never by the key itself."""
API_REQUESTS = MetricDef("tidal_api_requests", "counter",
                         "Requests with a valid API key at the ingress, by outcome (admitted, rate_limited)",
                         (KEY_TAG, "outcome"))
API_TOKENS = MetricDef("tidal_api_tokens", "counter", "Tokens used per API key, by kind (prompt, completion)",
                       (KEY_TAG, "kind"))
AUTH_FAILURES = MetricDef("tidal_auth_failures", "counter",
                          "Requests refused with 401 at the ingress: no API key or an unknown one", ())

ALL_METRICS: tuple[MetricDef, ...] = (
    TTFT, ITL, E2E, QUEUE_TIME, FRONT_DELAY, MICROWAIT, BATCH_SIZE, STEP_TIME, TTFT_PREDICTION,
    RUNNING, WAITING, KV_USAGE, REGIME, LOAD, CAPACITY, QUEUE_DELAY, ADMISSION_LIMIT, SLOW_PROMPT_RATIO, COSTLY_LIMIT,
    MEASURED_TPOT, TPOT_AIM, BORROW_SCALE, OVERLOAD_PREFILL_CAP,
    PADDING_WASTE,
    UNITS_DESIRED, UNITS_DEMAND, BATCH_WAITING, BATCH_BACKLOG_TOKENS, BATCH_RUNNING,
    DISPATCHES, REJECTIONS, FRONT_REFUSALS, FRONT_AIM, PREEMPTIONS, FINISHED, PROMPT_TOKENS, GENERATION_TOKENS,
    ARRIVALS,
    ENGINE_ERRORS,
    PREFIX_QUERIED_TOKENS, PREFIX_HIT_TOKENS, PREFIX_QUERIED_REQUESTS, PREFIX_HIT_REQUESTS,
    BATCH_TOKENS,
    API_REQUESTS, API_TOKENS, AUTH_FAILURES,
)
