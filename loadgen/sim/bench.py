"""`tidal bench scheduler`: the cost of one scheduling cycle (`schedule()` + `on_step_done()`).

Wall time is what the issue asks for; thread CPU time is reported beside it because on a shared
machine preemption by other processes inflates the wall-time tail. Sets up a unit at steady
state: `--running` requests decoding (a full batch), `--waiting`
queued with mixed prompt lengths, output lengths mixed so that requests finish and new ones
are admitted (as prefill chunks) every few steps; the queue is topped up to stay at
`--waiting`. Only the two scheduler calls are timed; the executor's work is not.
`--prefix-caching` turns the prefix cache on with every prompt unique (hashed blocks, no hits):
the cost of the cache's lookups and registrations when it saves nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tidal_core import AdmissionConfig, Request, Run, SamplingParams, Scheduler, SchedulerConfig, StepResult, preset
from tidal_core.plan import StepPlan


class _CountingExecutor:
    """Samples a token wherever the contract says one is due; tracks only prefill lengths."""

    def __init__(self) -> None:
        self.prefill_len: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for new in plan.new_requests:
            self.prefill_len[new.request_id] = new.num_tokens
        for rid in plan.finished_ids:
            self.prefill_len.pop(rid, None)
        sampled = dict.fromkeys(plan.num_scheduled_tokens, 11)
        for rid, ctx in plan.prefill_context.items():
            if ctx + plan.num_scheduled_tokens[rid] < self.prefill_len[rid]:
                del sampled[rid]
            else:
                del self.prefill_len[rid]
        return StepResult(plan.step_id, sampled, 0.03)


def _request(i: int, rng: random.Random, now: float, hashed: bool = False) -> Request:
    prompt = rng.choice((16, 64, 128, 256, 512, 1024, 2048))
    req = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(16, 512)), now)
    if hashed:  # unique per request: the cache is consulted and filled, never hit
        req.block_hashes = list(range(i << 12, (i << 12) + prompt // 16))
    return req


class BenchUnit:
    """One scheduler at the bench's steady state, stepped one timed cycle at a time."""

    def __init__(self, num_running: int, num_waiting: int, seed: int = 0, policy: str = "adaptive",
                 prefix_caching: bool = False, hashed: bool = False) -> None:
        self.rng = random.Random(seed)
        self.hashed, self.num_waiting = hashed, num_waiting
        base = SchedulerConfig(max_batch_size=num_running, max_num_batched_tokens=max(2048, num_running),
                               max_model_len=4096, block_size=16, num_kv_blocks=num_running * 200,
                               cuda_graph_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                               enable_prefix_caching=prefix_caching)
        # Admission limits relaxed so the bench can hold a 4096-deep queue; the checks still run.
        self.sched = Scheduler(preset(policy, base, admission=AdmissionConfig(max_queue_len=10**7,
                                                                              target_ttft_s=1e9)))
        self.ex = _CountingExecutor()
        self.now, self.next_id = 0.0, 0
        for _ in range(num_running):
            self._arrive()
        sched = self.sched
        while len(sched.decodes) < num_running // 2 or sched.prefilling:  # fill the running batch
            decision = sched.schedule(self.now)
            assert isinstance(decision, Run)
            self.now += 0.03
            sched.on_step_done(decision.plan, self.ex.execute(decision.plan), self.now)
        self.samples: list[float] = []
        self.cpu_samples: list[float] = []

    def _arrive(self) -> None:
        self.sched.add_request(_request(self.next_id, self.rng, self.now, self.hashed), self.now)
        self.next_id += 1

    def cycle(self) -> None:
        """Top the queue up (not timed), then time `schedule()` + `on_step_done()`."""
        sched = self.sched
        while sched.num_waiting < self.num_waiting:
            self._arrive()
        perf, cpu = time.perf_counter, time.thread_time
        c0, t0 = cpu(), perf()
        decision = sched.schedule(self.now)
        t1, c1 = perf(), cpu()
        assert isinstance(decision, Run)
        result = self.ex.execute(decision.plan)
        self.now += 0.03
        c2, t2 = cpu(), perf()
        sched.on_step_done(decision.plan, result, self.now)
        t3, c3 = perf(), cpu()
        self.samples.append((t1 - t0) + (t3 - t2))
        self.cpu_samples.append((c1 - c0) + (c3 - c2))

    def summary(self) -> dict[str, float]:
        samples, cpu_samples = sorted(self.samples), sorted(self.cpu_samples)
        return {
            "p50_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(samples[int(0.99 * (len(samples) - 1))] * 1e6, 1),
            "mean_us": round(statistics.fmean(samples) * 1e6, 1),
            # Thread CPU time: what the cycle costs when another process preempts this one (noisy box).
            "cpu_p50_us": round(statistics.median(cpu_samples) * 1e6, 1),
            "cpu_p99_us": round(cpu_samples[int(0.99 * (len(cpu_samples) - 1))] * 1e6, 1),
            "cycles": len(samples),
            "running": len(self.sched.decodes) + len(self.sched.prefilling),
            "waiting": self.sched.num_waiting,
        }


def bench_scheduler(num_running: int, num_waiting: int, cycles: int, seed: int = 0,
                    policy: str = "adaptive", prefix_caching: bool = False,
                    hashed: bool | None = None) -> dict[str, float]:
    """`hashed` (default: as `prefix_caching`) gives every prompt unique block hashes."""
    unit = BenchUnit(num_running, num_waiting, seed, policy, prefix_caching,
                     prefix_caching if hashed is None else hashed)
    for _ in range(cycles):
        unit.cycle()
    return unit.summary()


def bench_interleaved(modes: dict[str, tuple[bool, bool]], num_running: int, num_waiting: int, cycles: int,
                      seed: int = 0, policy: str = "adaptive") -> dict[str, dict[str, float]]:
    """Several units (name -> (prefix_caching, hashed)), same seed, stepped in turn cycle by cycle,
    the order reversed every other cycle: a shared machine's slow spells fall on each alike."""
    units = {name: BenchUnit(num_running, num_waiting, seed, policy, on, hashed)
             for name, (on, hashed) in modes.items()}
    order = list(units.values())
    for i in range(cycles):
        for unit in (order if i % 2 == 0 else order[::-1]):
            unit.cycle()
    return {name: unit.summary() for name, unit in units.items()}


def run(args: argparse.Namespace) -> int:
    result = bench_scheduler(args.running, args.waiting, args.cycles, args.seed, args.policy, args.prefix_caching)
    if args.json:
        print(json.dumps({"p50_us": result["p50_us"], "p99_us": result["p99_us"]}))
    else:
        for key, value in result.items():
            print(f"{key:>8}: {value}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="micro-benchmarks")
    which = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    p = which.add_parser("scheduler", help="time one schedule() + on_step_done() cycle")
    p.add_argument("--running", type=int, default=256, help="requests in the running batch")
    p.add_argument("--waiting", type=int, default=4096, help="requests kept queued")
    p.add_argument("--cycles", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--prefix-caching", action="store_true", help="prefix cache on, every prompt unique (no hits)")
    p.add_argument("--json", action="store_true", help='print only {"p50_us": ..., "p99_us": ...}')
    p.set_defaults(func=run)
