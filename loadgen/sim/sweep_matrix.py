"""What `tidal sweep` runs: the matrix of traffic x GPU x SLO, and each baseline's knob grid.

Owns: `Family` (a policy preset and the knob the sweep varies, with its grid; optionally a
second grid of batch caps), `FAMILIES`, `capped_family` (`tidal sweep --seqs`) and `ablations()`
(the policies compared), `Cell` (one trace x rate x GPU) with `cell_trace`
(the traffic it replays), `SLOS` and the default axes. Nothing here runs a simulation
(loadgen/sim/sweep_run.py does).

The traffic of a cell:
- `azure-code`, `azure-conv`, `mooncake-conv`: the first `minutes` of the real trace, thinned or
  replicated to `rate` x its own rate;
- `constant`: gamma arrivals (CV 1.1) at `rate` x the unit's measured capacity, conversation lengths;
- `sharp-day-conv`, `sharp-day-code`, `servegen-day-conv`: a synthetic 24 h day whose peak is
  1.3 x `rate` x the unit's capacity measured on the same lengths, played with each hour
  lasting `day_minutes` minutes (rates unchanged, so a day holds `day_minutes`/60 of its
  requests); per-hour tables use those compressed hours.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from calibration.cost_model import CostModel
from loadgen.arrivals import gamma_arrival_times, rate_for_peak_load, servegen_day_curve, sharp_day_curve
from loadgen.lengths import sample_length_arrays
from loadgen.ratecurve import RateCurve
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.sim.runner import measure_capacity
from loadgen.traces import DEFAULT_DAY_CV, load_trace
from tidal_core import POLICIES, SchedulerConfig

BUDGETS = (128, 256, 512, 1024, 2048, 4096)
CAPS = (8, 16, 32, 64, 128, 256, 512, 1024)
# The second knob a vLLM user tunes beside the token budget (`max_num_seqs`): `tidal sweep --seqs`.
SEQS = (16, 32, 64)
CAPPED = "sarathi-seqs"
REAL_TRACES = ("azure-code", "azure-conv", "mooncake-conv")
DAYS = {"sharp-day-conv": ("sharp", "azure-conv"), "sharp-day-code": ("sharp", "azure-code"),
        "servegen-day-conv": ("servegen", "azure-conv")}
TRACES = (*REAL_TRACES, "constant", *DAYS)
RATES = (0.3, 1.0, 3.0)
GPUS = ("a100-llama70b-tp8", "h100-llama70b-tp8")
# The default SLO, and a pair for streaming chat: a slower first token allowed, a faster stream asked.
SLOS = {"ttft1-tpot100": Slo(1.0, 0.1), "ttft2-tpot75": Slo(2.0, 0.075)}
DAY_PEAK_LOAD = 1.3


@dataclass(frozen=True)
class Family:
    """A policy preset and the knob the sweep varies (`knob` None: the policy as shipped); with
    `seqs`, every grid value also at each of those batch caps (`max_batch_size`)."""

    name: str
    preset: str
    knob: str | None = None
    values: tuple[int, ...] = ()
    seqs: tuple[int, ...] = ()

    def variants(self) -> list[tuple[str, dict[str, str]]]:
        """(label, `--set` overrides) per grid value (`name@value`, or `name@value/cap` with `seqs`);
        the preset as shipped when it has no knob."""
        if self.knob is None:
            return [(self.name, {})]
        if self.seqs:
            return [(f"{self.name}@{v}/{c}", {self.knob: str(v), "max_batch_size": str(c)})
                    for v in self.values for c in self.seqs]
        return [(f"{self.name}@{v}", {self.knob: str(v)}) for v in self.values]


def capped_family(budgets: tuple[int, ...] = BUDGETS, seqs: tuple[int, ...] = SEQS) -> Family:
    """`sarathi` with both knobs a vLLM user tunes: each token budget at each batch cap. Under a
    tight TPOT target the batch cap of 128 lets no budget hold it on a slow GPU, and the best of
    the one-knob grid is then a concurrency cap without SLO admission (docs/day-in-the-life.md §1)."""
    return Family(CAPPED, "sarathi", "max_num_batched_tokens", budgets, seqs)


FAMILIES = (
    Family("adaptive", "adaptive"),
    Family("vllm", "vllm", "max_num_batched_tokens", BUDGETS),
    Family("sarathi", "sarathi", "max_num_batched_tokens", BUDGETS),
    Family("tgi", "tgi", "admission.max_concurrent_requests", CAPS),
    Family("ray-serve", "ray-serve", "admission.max_queued_requests", CAPS),
)
# Before the named baselines exist, the same knobs on the presets that do (see `available`).
_FALLBACK = {"vllm": Family("vllm", "continuous", "max_num_batched_tokens", BUDGETS)}


def available(families: tuple[Family, ...] = FAMILIES) -> tuple[list[Family], list[str]]:
    """The families whose preset exists in this core, and the names of those that do not."""
    have, missing = [], []
    for fam in families:
        if fam.preset in POLICIES:
            have.append(fam)
        elif fam.name in _FALLBACK:
            have.append(_FALLBACK[fam.name])
            missing.append(f"{fam.name} (ran as {_FALLBACK[fam.name].preset})")
        else:
            missing.append(fam.name)
    return have, missing


def ablations() -> list[Family]:
    """Adaptive without each of its parts, and continuous with adaptive's admission only."""
    names = [p for p in POLICIES if p.startswith(("adaptive-", "continuous-"))]
    return [Family(p, p) for p in names]


@dataclass(frozen=True)
class Cell:
    trace: str
    rate: float
    gpu: str

    @property
    def key(self) -> str:
        return f"{self.trace}__x{self.rate:g}__{self.gpu}"

    @property
    def is_day(self) -> bool:
        return self.trace in DAYS


@dataclass
class Window:
    """How much of each trace a cell plays."""

    minutes: float = 10.0
    day_minutes: float = 2.5
    seed: int = 0
    _capacity: dict[tuple[str, str], float] = field(default_factory=dict)

    def capacity(self, cost: CostModel, base: SchedulerConfig, lengths: str) -> float:
        """Requests/s one unit completes saturated on `lengths` (the `continuous` policy)."""
        key = (cost.name, lengths)
        if key not in self._capacity:
            inp, out = sample_length_arrays(3000, source=lengths, seed=12345, max_input=base.max_model_len - 1,
                                            max_output=base.max_model_len - 1)
            mix = Trace(f"{lengths}-lengths", np.zeros(inp.size), inp, out, duration_s=0.0, source=lengths)
            self._capacity[key] = measure_capacity(cost, base, mix)
        return self._capacity[key]

    def hour_s(self, cell: Cell) -> float:
        return 60.0 * self.day_minutes if cell.is_day else 3600.0


def cell_trace(cell: Cell, cost: CostModel, base: SchedulerConfig, window: Window) -> Trace:
    max_len = base.max_model_len - 1
    seed = window.seed
    if cell.trace in REAL_TRACES:
        trace = load_trace(cell.trace, hours=window.minutes / 60.0, seed=seed, rate_scale=cell.rate)
        return trace.clipped(max_len, max_len)
    if cell.trace == "constant":
        rate = cell.rate * window.capacity(cost, base, "azure-conv")
        span = window.minutes * 60.0
        arrival = gamma_arrival_times(RateCurve.constant(rate, span), cv=DEFAULT_DAY_CV, seed=seed, end_s=span)
        inp, out = sample_length_arrays(arrival.size, source="azure-conv", seed=seed, max_input=max_len,
                                        max_output=max_len)
        return Trace(f"constant {cell.rate:g}x capacity ({rate:.3g} rps)", arrival, inp, out, duration_s=span,
                     source="gamma arrivals, CV 1.1; azure-conv lengths")
    shape, lengths = DAYS[cell.trace]
    curve = servegen_day_curve("m-large", mean_rps=1.0) if shape == "servegen" else sharp_day_curve(peak_rps=1.0)
    capacity = window.capacity(cost, base, lengths)
    curve = curve.scaled(rate_for_peak_load(curve, capacity, DAY_PEAK_LOAD * cell.rate))
    squeeze = window.day_minutes / 60.0
    squeezed = RateCurve(curve.times_s * squeeze, curve.rates_rps)
    span = 24 * 60.0 * window.day_minutes
    arrival = gamma_arrival_times(squeezed, cv=DEFAULT_DAY_CV, seed=seed, end_s=span)
    inp, out = sample_length_arrays(arrival.size, source=lengths, seed=seed, max_input=max_len, max_output=max_len)
    return Trace(f"{cell.trace} (peak {DAY_PEAK_LOAD * cell.rate:g}x capacity, hours of {window.day_minutes:g} min)",
                 arrival, inp, out, duration_s=span, source=f"{shape} day; {lengths} lengths; seed {seed}")


def cells(traces: tuple[str, ...] | list[str] = TRACES, rates: tuple[float, ...] | list[float] = RATES,
          gpus: tuple[str, ...] | list[str] = GPUS) -> list[Cell]:
    """Rate 1x first, then the others in the order given; within a rate, GPU by GPU. A sweep
    cut short has the cells the goals are first judged on."""
    order = sorted(rates, key=lambda r: (r != 1.0, list(rates).index(r)))
    return [Cell(t, r, g) for r in order for g in gpus for t in traces]
