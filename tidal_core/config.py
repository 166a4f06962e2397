"""Scheduler configuration: frozen, validated, no I/O.

Owns: `SchedulerConfig` and its parts (`BatchingConfig`, `RegimeConfig`, `AdmissionConfig`,
`StepSizingConfig`, `ServicePrior`; the batch class's `BatchClassConfig` lives in
batch_config.py). Every error message names the value and the fix. YAML and environment
variables are read at the edge (serve_app/config_loader.py), never here.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal_core.batch_config import BatchClassConfig

MICROWAIT_HARD_CAP_S = 0.005
"""No adaptive micro-wait ever exceeds 5 ms, whatever the config says (the seed's rule)."""

BATCHING_MODES = ("none", "adaptive", "fixed", "static")
ADMISSION_MODES = ("slo", "protect")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """When new prefills launch.

    mode "none": at once. "adaptive": micro-wait `clamp(t_max*(1-load), t_min, t_max)`,
    capped at 5 ms. "fixed": hold new prefills until the oldest has waited `fixed_wait_s`
    or a batch is full (Triton max_queue_delay, Ray @serve.batch). "static": admit only
    when nothing runs, once `static_batch_size` wait or the oldest waited `static_timeout_s`.
    """

    mode: str = "adaptive"
    t_min_s: float = 0.0005
    t_max_s: float = 0.003
    light_load: float = 0.15
    saturation_prompt_tokens: int = 512
    fixed_wait_s: float = 0.010
    static_batch_size: int = 64
    static_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        _require(self.mode in BATCHING_MODES,
                 f"batching.mode={self.mode!r} is unknown; use one of {BATCHING_MODES}")
        _require(0.0 <= self.t_min_s <= self.t_max_s,
                 f"batching.t_min_s={self.t_min_s} must be >= 0 and <= t_max_s={self.t_max_s}")
        _require(0.0 <= self.light_load < 1.0,
                 f"batching.light_load={self.light_load} must be in [0, 1)")
        _require(self.saturation_prompt_tokens >= 1,
                 f"batching.saturation_prompt_tokens={self.saturation_prompt_tokens} must be >= 1")
        _require(0.0 <= self.fixed_wait_s <= 10.0,
                 f"batching.fixed_wait_s={self.fixed_wait_s} must be in [0, 10] seconds")
        _require(self.static_batch_size >= 1,
                 f"batching.static_batch_size={self.static_batch_size} must be >= 1")
        _require(0.0 <= self.static_timeout_s <= 60.0,
                 f"batching.static_timeout_s={self.static_timeout_s} must be in [0, 60] seconds")


@dataclass(frozen=True, slots=True)
class RegimeConfig:
    """LIGHT / STEADY / OVERLOAD thresholds, all relative to measured capacity.

    `load` is utilisation (see core/load.py). OVERLOAD is entered when load >= overload_enter,
    or the predicted queueing delay exceeds `queue_delay_overload` x target TTFT, or KV usage
    >= kv_overload, or at least `refused_overload` of the recent arrivals (time constant
    `refused_tau_s`) were refused for the work ahead of them (core/regime.py BACKLOG_REASONS);
    it is left only when all four are below their exit marks. A change is taken only after the
    observations called for it without a break for `min_dwell_s`.

    The refusals are the overload that utilisation cannot see: long prompts arriving together
    miss the TTFT target behind each other on a unit whose GPU time would serve them all (one
    A100 70B unit on Mooncake's 8k-token prompts at 0.3x the trace's rate: load about 1.0, 63%
    refused). Both marks above 1 turn the signal off.
    """

    light_enter: float = 0.15
    light_exit: float = 0.25
    overload_enter: float = 1.0
    overload_exit: float = 0.85
    queue_delay_overload: float = 1.0
    queue_delay_exit: float = 0.5
    kv_overload: float = 0.95
    kv_overload_exit: float = 0.85
    min_dwell_s: float = 1.0
    refused_overload: float = 0.25
    refused_exit: float = 0.1
    refused_tau_s: float = 30.0
    enabled: bool = True  # False: the unit stays STEADY (the "no regimes" ablation)

    def __post_init__(self) -> None:
        _require(0.0 <= self.light_enter <= self.light_exit,
                 f"regime.light_enter={self.light_enter} must be >= 0 and <= light_exit={self.light_exit}")
        _require(self.light_exit < self.overload_exit <= self.overload_enter,
                 "regime thresholds must satisfy light_exit < overload_exit <= overload_enter; got "
                 f"{self.light_exit}, {self.overload_exit}, {self.overload_enter}")
        _require(0.0 < self.queue_delay_exit <= self.queue_delay_overload,
                 f"regime.queue_delay_exit={self.queue_delay_exit} must be in (0, queue_delay_overload]")
        _require(0.0 < self.kv_overload_exit <= self.kv_overload <= 1.0,
                 f"regime.kv_overload_exit={self.kv_overload_exit} must be <= kv_overload={self.kv_overload} <= 1")
        _require(self.min_dwell_s >= 0.0, f"regime.min_dwell_s={self.min_dwell_s} must be >= 0")
        _require(0.0 < self.refused_exit <= self.refused_overload,
                 f"regime.refused_exit={self.refused_exit} must be in (0, refused_overload={self.refused_overload}] "
                 "(both above 1: refusals never call for OVERLOAD)")
        _require(self.refused_tau_s > 0.0, f"regime.refused_tau_s={self.refused_tau_s} must be > 0")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Early rejection (HTTP 429 + Retry-After) so admitted requests keep their SLO.

    With `enabled`, a request is turned away when the queue holds `max_queue_len`, when the
    predicted queueing delay of the prefill tokens ahead of it exceeds `target_ttft_s`
    (the queued-prefill-token cap, i.e. about target TTFT x prefill throughput), or when KV
    usage is at `kv_reject_usage` with requests already waiting for room. `target_tpot_s` is
    the time-per-output-token half of the SLO (None: no TPOT target); the step sizer
    (`StepSizingConfig`, core/step_sizer.py) holds admitted requests to it.

    `mode` "slo" (the default: production) applies every rule above. "protect" (a dev server)
    keeps only what protects the process, the bounded queue (`max_queue_len`): a request that
    would miss `target_ttft_s`, or that finds the KV cache full, waits its turn instead of
    getting a 429 (the KV pool is fixed at start and the scheduler never admits past it, so
    queueing costs latency, not memory).

    The TTFT limit is learned (`aim_gain` > 0): admission refuses a request with work ahead
    when its prediction exceeds `aim` x the limit, and `aim` (a fraction, from `aim_start`)
    moves with each first token of a request admitted with work ahead: down by `aim_gain` x
    (1 - `aim_tail`) when it missed `target_ttft_s`, up by `aim_gain` x `aim_tail` when it made
    it, within [`aim_floor`, 1]. It settles where about `aim_tail` of those requests miss: a
    prediction calibrated at its median misses half the requests admitted right at the target
    (every one of them in a burst), so the aim keeps the queue where the prediction's spread
    still fits (core/admission.py `TtftAim`).

    With `refuse_slow_prompts_in_overload` (the default), a request whose own TTFT would pass
    `target_ttft_s` with nothing ahead of it is refused in OVERLOAD (`prompt_over_target`) and
    served otherwise; off, a request nothing is ahead of is always admitted (core/admission.py).
    It judges by a bound times a learned ratio of measured TTFT to it, at `slow_prompt_quantile`
    of that ratio (0.5: refused when it more likely misses than not; higher refuses prompts with
    a smaller chance to miss).
    With `shed_costly_prompts_in_overload` (off by default), a unit over its capacity refuses the
    prompts too costly to fit beside the cheaper ones (`costly_prompt`, core/costly_prompts.py):
    in a sustained overload it serves the most requests within the SLO; off, a long prompt
    competes with the rest (after a burst, retrying clients' long prompts get in).

    Two plain caps apply whether or not `enabled` is set (the baselines users run):
    `max_concurrent_requests` on requests in the unit (TGI's limit) and `max_queued_requests`
    on requests waiting (Ray Serve's); None is no cap.
    """

    enabled: bool = True
    mode: str = "slo"
    max_queue_len: int = 1024
    target_ttft_s: float = 1.0
    target_tpot_s: float | None = None
    burst_factor: float = 1.0
    kv_reject_usage: float = 0.98
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    aim_start: float = 1.0
    aim_gain: float = 0.02
    aim_tail: float = 0.05
    aim_floor: float = 0.5
    refuse_slow_prompts_in_overload: bool = True
    slow_prompt_quantile: float = 0.5
    shed_costly_prompts_in_overload: bool = False

    def __post_init__(self) -> None:
        _require(self.mode in ADMISSION_MODES,
                 f"admission.mode={self.mode!r} is unknown; use 'slo' (reject to keep the TTFT target) or "
                 "'protect' (only a full queue is refused)")
        _require(self.max_concurrent_requests is None or self.max_concurrent_requests >= 1,
                 f"admission.max_concurrent_requests={self.max_concurrent_requests} must be None (no cap) or >= 1")
        _require(self.max_queued_requests is None or self.max_queued_requests >= 0,
                 f"admission.max_queued_requests={self.max_queued_requests} must be None (no cap) or >= 0")
        _require(self.max_queue_len >= 1, f"admission.max_queue_len={self.max_queue_len} must be >= 1")
        _require(self.target_ttft_s > 0.0, f"admission.target_ttft_s={self.target_ttft_s} must be > 0")
        _require(self.burst_factor >= 1.0, f"admission.burst_factor={self.burst_factor} must be >= 1")
        _require(0.0 <= self.aim_gain <= 0.2,
                 f"admission.aim_gain={self.aim_gain} must be in [0, 0.2] (0: the aim stays at aim_start)")
        _require(0.0 < self.aim_tail < 0.5, f"admission.aim_tail={self.aim_tail} must be in (0, 0.5)")
        _require(0.1 <= self.aim_floor <= 1.0, f"admission.aim_floor={self.aim_floor} must be in [0.1, 1]")
        _require(self.aim_floor <= self.aim_start <= 1.0,
                 f"admission.aim_start={self.aim_start} must be in [aim_floor={self.aim_floor}, 1]")
        _require(0.05 <= self.slow_prompt_quantile <= 0.95,
                 f"admission.slow_prompt_quantile={self.slow_prompt_quantile} must be in [0.05, 0.95]")
        _require(self.target_tpot_s is None or self.target_tpot_s > 0.0,
                 f"admission.target_tpot_s={self.target_tpot_s} must be None (off) or > 0")
        _require(0.0 < self.kv_reject_usage <= 1.0,
                 f"admission.kv_reject_usage={self.kv_reject_usage} must be in (0, 1]")
        _require(0.0 < self.min_retry_after_s <= self.max_retry_after_s,
                 f"admission.min_retry_after_s={self.min_retry_after_s} must be > 0 and <= max_retry_after_s")


@dataclass(frozen=True, slots=True)
class StepSizingConfig:
    """How big each step may be so running decodes keep `admission.target_tpot_s` (core/step_sizer.py).

    The step sizer aims at `headroom` x the target; a decode-only step may use `decode_share`
    of that aim (the running-batch cap). Each decode banks what its steps came in under the
    aim; a step may be as long as the aim plus the smallest bank of the decodes in it, at most
    `max_bank_steps` aims. A decode may borrow against the tokens it is still expected to
    produce: the `borrow_quantile` of what finished requests produced past that point (0:
    never); when the oldest prompt has waited `pressure_fraction` of the TTFT target, the
    `pressure_quantile` instead. Each of those tokens is credited with what a decode-only step
    repays, but in OVERLOAD with the repayment measured over the last `repay_steps` decode
    steps (zero on a unit that fills every step: nothing is borrowed there).
    With `defer` a step whose allowance would cut the oldest prompt's chunk small holds no
    prefill when a decode-only step, then one bigger chunk, computes the queue's prompts faster
    (each prefill step pays a fixed cost and the decodes' time; `StepSizer.defer`).
    With `aim_gain` > 0 the aim is learned from finished requests' TPOT: down by `aim_gain` x
    (1 - `aim_tail`) for one that came within `aim_band` of the target, up by `aim_gain` x
    `aim_tail` for any other, within [`aim_floor`, 1] x the target (`headroom` is where it
    starts); the TPOT p99 then sits near (1 - `aim_band`) x the target. With `borrow_gain` > 0
    both quantiles are scaled by a factor learned the same way from the requests that missed the
    target itself (down by `borrow_gain` x (1 - `borrow_tail`) for each, up by `borrow_gain` x
    `borrow_tail` for any other, within [0, 1]): about `borrow_tail` of them miss, however short.
    With `slot_gain` > 0, in OVERLOAD a step's prompt tokens are also held under a cap learned
    from `max_num_batched_tokens` down (core/step_limits.py): down by `slot_gain` x (1 -
    `slot_tail`) on a step that finds prompts waiting with `max_batch_size` requests running
    while the decode steps leave over half the aim unused and the load is at least
    `slot_min_load` (core/load.py, `LoadEstimator.overload`), up by `slot_gain` x `slot_tail` on
    one whose prompts the allowance cut with a slot free, so about `slot_tail` of those steps find
    the batch full.
    Off (`enabled=False`) or without a TPOT target, steps are bounded only by the token budget.
    """

    enabled: bool = True
    headroom: float = 0.95
    decode_share: float = 0.9
    max_bank_steps: float = 50.0
    borrow_quantile: float = 0.01
    pressure_quantile: float = 0.05
    pressure_fraction: float = 0.5
    repay_steps: float = 128.0
    aim_gain: float = 0.005
    aim_band: float = 0.02
    aim_tail: float = 0.01
    aim_floor: float = 0.8
    borrow_gain: float = 0.05
    borrow_tail: float = 0.005
    defer: bool = True
    slot_gain: float = 0.005
    slot_tail: float = 0.02
    slot_min_load: float = 1.5

    def __post_init__(self) -> None:
        _require(self.borrow_quantile <= self.pressure_quantile <= 1.0,
                 f"step_sizing.pressure_quantile={self.pressure_quantile} must be in [borrow_quantile, 1]")
        _require(0.0 < self.pressure_fraction <= 10.0,
                 f"step_sizing.pressure_fraction={self.pressure_fraction} must be in (0, 10]")
        _require(0.0 <= self.borrow_quantile <= 0.5,
                 f"step_sizing.borrow_quantile={self.borrow_quantile} must be in [0, 0.5] (0: no borrowing)")
        _require(0.1 <= self.headroom <= 1.5, f"step_sizing.headroom={self.headroom} must be in [0.1, 1.5]")
        _require(0.1 <= self.decode_share <= 1.0,
                 f"step_sizing.decode_share={self.decode_share} must be in [0.1, 1]")
        _require(self.max_bank_steps >= 0.0, f"step_sizing.max_bank_steps={self.max_bank_steps} must be >= 0")
        _require(self.repay_steps >= 1.0, f"step_sizing.repay_steps={self.repay_steps} must be >= 1 (decode steps)")
        _require(0.0 <= self.aim_gain <= 0.1,
                 f"step_sizing.aim_gain={self.aim_gain} must be in [0, 0.1] (0: the aim stays at headroom)")
        _require(0.0 < self.aim_band < 0.5, f"step_sizing.aim_band={self.aim_band} must be in (0, 0.5)")
        _require(0.0 < self.aim_tail < 0.5, f"step_sizing.aim_tail={self.aim_tail} must be in (0, 0.5)")
        _require(0.1 <= self.aim_floor <= 1.0, f"step_sizing.aim_floor={self.aim_floor} must be in [0.1, 1]")
        _require(0.0 <= self.borrow_gain <= 0.2,
                 f"step_sizing.borrow_gain={self.borrow_gain} must be in [0, 0.2] (0: borrowing is never scaled)")
        _require(0.0 < self.borrow_tail < 0.5, f"step_sizing.borrow_tail={self.borrow_tail} must be in (0, 0.5)")
        _require(0.0 <= self.slot_gain <= 0.1,
                 f"step_sizing.slot_gain={self.slot_gain} must be in [0, 0.1] (0: no learned OVERLOAD prefill cap)")
        _require(0.0 < self.slot_tail < 0.5, f"step_sizing.slot_tail={self.slot_tail} must be in (0, 0.5)")
        _require(self.slot_min_load >= 1.0, f"step_sizing.slot_min_load={self.slot_min_load} must be >= 1")
        _require(self.aim_gain == 0.0 or self.aim_floor <= self.headroom <= 1.0,
                 f"step_sizing.headroom={self.headroom} must be in [aim_floor={self.aim_floor}, 1] when the aim is "
                 "learned (aim_gain > 0); set aim_gain=0 to aim at a fixed headroom")


@dataclass(frozen=True, slots=True)
class ServicePrior:
    """Starting guess of the step-time model
    `t = overhead + prefill_step*[any prefill] + a*prefill_tokens + b*decode_seqs`.

    The scheduler refines it online from measured step times (core/load.py); a good prior
    (from the cost model or the profiler) only shortens the warm-up.
    """

    step_overhead_s: float = 0.030
    prefill_s_per_token: float = 0.00012
    decode_s_per_seq: float = 0.0003
    prefill_step_s: float = 0.0

    def __post_init__(self) -> None:
        _require(self.step_overhead_s > 0.0, f"service_prior.step_overhead_s={self.step_overhead_s} must be > 0")
        _require(self.prefill_s_per_token > 0.0,
                 f"service_prior.prefill_s_per_token={self.prefill_s_per_token} must be > 0")
        _require(self.decode_s_per_seq >= 0.0, f"service_prior.decode_s_per_seq={self.decode_s_per_seq} must be >= 0")
        _require(self.prefill_step_s >= 0.0, f"service_prior.prefill_step_s={self.prefill_step_s} must be >= 0")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything one serving unit's scheduler needs. Build presets with `core.presets`."""

    policy: str = "adaptive"
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 8192
    kv_watermark: float = 0.01
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    prefix_cache_namespace: str = ""  # the model / adapter identity seeding the block hashes
    max_new_requests_per_step: int | None = None
    max_prefill_tokens: int | None = None  # prefill tokens per step (TGI's max_batch_prefill_tokens)
    cuda_graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    load_tau_s: float = 10.0
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    regime: RegimeConfig = field(default_factory=RegimeConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    step_sizing: StepSizingConfig = field(default_factory=StepSizingConfig)
    service_prior: ServicePrior = field(default_factory=ServicePrior)
    batch: BatchClassConfig = field(default_factory=BatchClassConfig)

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, f"max_batch_size={self.max_batch_size} must be >= 1")
        _require(self.max_num_batched_tokens >= self.max_batch_size,
                 f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_batch_size="
                 f"{self.max_batch_size} so every running decode fits in a step")
        _require(self.max_model_len >= 2, f"max_model_len={self.max_model_len} must be >= 2")
        _require(self.block_size >= 1, f"block_size={self.block_size} must be >= 1")
        _require(self.num_kv_blocks * self.block_size >= self.max_model_len,
                 f"num_kv_blocks={self.num_kv_blocks} x block_size={self.block_size} cannot hold one "
                 f"request of max_model_len={self.max_model_len}; add KV memory or lower max_model_len")
        _require(0.0 <= self.kv_watermark < 0.5, f"kv_watermark={self.kv_watermark} must be in [0, 0.5)")
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill max_num_batched_tokens={self.max_num_batched_tokens} must be "
                 f">= max_model_len={self.max_model_len}, or no long prompt could ever run")
        _require(self.max_new_requests_per_step is None or self.max_new_requests_per_step >= 1,
                 f"max_new_requests_per_step={self.max_new_requests_per_step} must be None or >= 1")
        _require(self.max_prefill_tokens is None or self.max_prefill_tokens >= 1,
                 f"max_prefill_tokens={self.max_prefill_tokens} must be None (no cap) or >= 1")
        buckets = self.cuda_graph_buckets
        _require(all(b >= 1 for b in buckets) and list(buckets) == sorted(set(buckets)),
                 f"cuda_graph_buckets={buckets} must be strictly increasing positive sizes")
        _require(self.load_tau_s > 0.0, f"load_tau_s={self.load_tau_s} must be > 0")
