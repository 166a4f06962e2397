"""A calibrated model of one engine step's time on a GPU group: the simulator's clock.

Owns: `CostCoefficients` (the fitted figures, in milliseconds, as stored in
calibration/costmodels/*.yaml) and `CostModel` (step time from what a step holds, the linearised
`ServicePrior`, YAML load/save). The figures come from `tidal fit-cost-model`
(calibration/fit.py); docs/cost-model.md gives the form, every source and the error.

Must not import: ray, torch, numpy, transformers (pure: the standard library, plus pyyaml
inside `load` only). `plan_time_s` runs once per simulated step, millions of times a day.

The form (form_version 1), per step, with T the tokens computed (the padded bucket for a
pure-decode step), P the prefill tokens, N the sequences, C the KV tokens the decodes attend:

    device = L*s*(roof(T) + 2*allreduce(T)) * (1 + gain*sigmoid(T))           GEMMs, norms, TP
           + attn_pair * sum(n*(ctx + n/2)) + attn_token * P + attn_decode * C   attention
    step   = max_r(host_floor, device)                                         host work overlaps
                (host_floor is graph_host_floor for a CUDA-graph step when the model has one)
           + step + prefill_step*[P > 0] + per_seq*N + decode_ctx*C             host work that does not

`roof(x) = (floor^p + (slope*x)^p)^(1/p)` (memory-bound at small x, compute-bound at large x),
`max_r(a, b) = (a^r + b^r)^(1/r)`, `sigmoid(T) = 1/(1 + (knee/T)^q)`. Every term is
non-decreasing in every input, so more work never gives a shorter step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tidal_core.config import ServicePrior
from tidal_core.plan import StepPlan

FORM_VERSION = 1
# Shipped as package data beside this module (calibration/costmodels/*.yaml).
COSTMODEL_DIR = Path(str(resources.files("calibration") / "costmodels"))
_CACHE_LIMIT = 1 << 16  # distinct token counts memoised for the token-proportional block


def shipped_names() -> list[str]:
    """The cost models shipped under calibration/costmodels, by the name `CostModel.load` takes."""
    return sorted(p.stem for p in COSTMODEL_DIR.glob("*.yaml"))


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """Every figure of the form above. Durations in milliseconds; per layer where named so."""

    num_layers: int
    linear_floor_ms: float          # per layer: non-attention ops at 1 token (weight reads)
    linear_ms_per_token: float      # per layer: their compute-bound slope
    linear_smoothness: float        # p of the roofline's smooth max
    allreduce_floor_ms: float       # one all-reduce of 1 token's hidden state
    allreduce_ms_per_token: float
    allreduce_smoothness: float
    linear_scale: float             # s: the measured stack vs the operator profile
    large_step_gain: float          # extra cost of the token-proportional block above the knee
    large_step_knee_tokens: float
    large_step_sharpness: float
    attn_prefill_ms_per_pair: float   # per (query token x key token), causal pairs
    attn_prefill_ms_per_token: float
    attn_decode_ms_per_token: float   # KV reads of decodes (device)
    host_floor_ms: float            # host time per step that overlaps device work
    host_overlap: float             # r of max_r; 1 means none of it overlaps
    step_ms: float                  # per step, not overlapped
    prefill_step_ms: float          # per step that holds prefill tokens
    per_seq_ms: float               # per sequence in the step
    decode_ctx_ms_per_token: float  # per KV token the decodes attend (host side of the fit)
    # host_floor of a CUDA-graph step (one replay, no per-kernel launches); None: host_floor, as for
    # models fitted on eager engines. Optional in the YAML, written only when set.
    graph_host_floor_ms: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in OPTIONAL:
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {f.name}={value!r} must be a finite number >= 0")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        for name in ("linear_smoothness", "allreduce_smoothness", "host_overlap"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (1 is a plain sum)")
        if self.large_step_knee_tokens <= 0 or self.large_step_sharpness <= 0:
            raise ValueError("large_step_knee_tokens and large_step_sharpness must be > 0")

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in OPTIONAL and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostCoefficients:
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = names - OPTIONAL - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"cost model coefficients: missing {sorted(missing)}, unknown {sorted(unknown)}")
        values: dict[str, Any] = {k: (int(v) if k == "num_layers" else None if v is None else float(v))
                                  for k, v in data.items()}
        return cls(**values)


OPTIONAL = frozenset({"graph_host_floor_ms"})  # coefficients a YAML may leave out


class CostModel:
    """Step time of one engine step on one serving unit (one GPU group of `tp` GPUs).

    `include_host=False` (see `device_only`) drops every host term: what a "simulated GPU"
    replica should sleep when a real router loop already pays its own per-step overhead.
    """

    __slots__ = ("_g_cache", "_k", "coefficients", "description", "fit", "gpu", "include_host", "model",
                 "name", "sources", "tp")

    def __init__(self, name: str, gpu: str, model: str, tp: int, coefficients: CostCoefficients, *,
                 include_host: bool = True, description: str = "", sources: list[dict[str, Any]] | None = None,
                 fit: dict[str, Any] | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tp={tp} must be >= 1")
        self.name, self.gpu, self.model, self.tp = name, gpu, model, tp
        self.coefficients = coefficients
        self.include_host = include_host
        self.description = description
        self.sources = sources or []
        self.fit = fit or {}
        self._k = _Precomputed(coefficients)
        self._g_cache: dict[int, float] = {}

    # ---- the hot path ------------------------------------------------------------------------
    def plan_time_s(self, plan: StepPlan) -> float:
        sched = plan.num_scheduled_tokens
        pairs = 0.0
        for rid, ctx in plan.prefill_context.items():
            n = sched[rid]
            pairs += n * (ctx + 0.5 * n)
        return self._time(plan.num_prefill_tokens, len(plan.prefill_context), pairs, plan.num_decode_seqs,
                          plan.decode_context_tokens, plan.padded_batch_size)

    def step_time_s(self, prefill_chunks: Sequence[tuple[int, int]], num_decode_seqs: int,
                    decode_context_tokens: int, padded_batch_size: int | None) -> float:
        """`prefill_chunks` holds (num_tokens, prior_context) per prefill chunk in the step."""
        prefill = sum(n for n, _ in prefill_chunks)
        pairs = sum(n * (ctx + 0.5 * n) for n, ctx in prefill_chunks)
        return self._time(prefill, len(prefill_chunks), pairs, num_decode_seqs, decode_context_tokens,
                          padded_batch_size)

    def _time(self, prefill: int, num_chunks: int, pairs: float, num_decode: int, decode_ctx: int,
              padded: int | None) -> float:
        tokens = prefill + num_decode
        if padded is not None and padded > tokens:
            tokens = padded  # a CUDA-graph step computes the GEMMs for the whole bucket
        if tokens <= 0:
            return 0.0
        k = self._k
        g = self._g_cache.get(tokens)
        if g is None:
            g = self._token_block(tokens)
        device = g + k.attn_pair * pairs + k.attn_token * prefill + k.attn_decode * decode_ctx
        if not self.include_host:
            return device
        r = k.overlap
        # a replayed graph (a padded step) has its own host floor: host_floor unless the model sets one
        if r == 1.0:
            overlapped: float = device + (k.graph_host_floor if padded is not None else k.host_floor)
        else:
            floor_r = k.graph_host_floor_r if padded is not None else k.host_floor_r
            overlapped = (floor_r + device ** r) ** k.inv_overlap
        t = overlapped + k.step + k.per_seq * (num_chunks + num_decode) + k.decode_ctx * decode_ctx
        return t + k.prefill_step if prefill else t

    def _token_block(self, tokens: int) -> float:
        """Seconds of the token-proportional block (GEMMs, norms, all-reduces) for `tokens`."""
        k = self._k
        lin: float = (k.lin_floor_p + (k.lin_slope * tokens) ** k.lin_p) ** k.lin_inv_p
        ar: float = (k.ar_floor_p + (k.ar_slope * tokens) ** k.ar_p) ** k.ar_inv_p
        g: float = (lin + ar) * (1.0 + k.gain / (1.0 + (k.knee / tokens) ** k.sharpness))
        if len(self._g_cache) >= _CACHE_LIMIT:
            self._g_cache.clear()
        self._g_cache[tokens] = g
        return g

    # ---- derived views -------------------------------------------------------------------------
    def device_only(self) -> CostModel:
        """The same model without host terms (for a replica whose router pays real overhead)."""
        return CostModel(self.name, self.gpu, self.model, self.tp, self.coefficients, include_host=False,
                         description=self.description, sources=self.sources, fit=self.fit)

    def service_prior(self) -> ServicePrior:
        """`overhead + prefill_step*[prefill] + a*prefill_tokens + b*decode_seqs`, least squares
        over typical steps (the scheduler's online model, tidal_core/load.py, starts here).

        The grid: pure decodes of 1..max batch at 1024 context (CUDA-graph padded), single
        prefills of 128..2048 tokens, and 32 decodes with a 256..1024-token chunk; each row is
        weighted by 1/time so short steps count as much as long ones.
        """
        rows: list[tuple[float, ...]] = []
        for d in (1, 2, 4, 8, 16, 32, 64, 128):
            rows.append((1.0, 0.0, 0.0, d, self.step_time_s((), d, 1024 * d, d if d <= 64 else None)))
        for p in (128, 256, 512, 1024, 2048):
            rows.append((1.0, 1.0, p, 0, self.step_time_s(((p, 0),), 0, 0, None)))
        for p in (256, 512, 1024):
            rows.append((1.0, 1.0, p, 32, self.step_time_s(((p, 1024),), 32, 32 * 1024, None)))
        overhead, prefill_step, per_token, per_seq = _weighted_lstsq(rows)
        fallback = ServicePrior()
        return ServicePrior(step_overhead_s=overhead if overhead > 0 else fallback.step_overhead_s,
                            prefill_s_per_token=per_token if per_token > 0 else fallback.prefill_s_per_token,
                            decode_s_per_seq=max(per_seq, 0.0), prefill_step_s=max(prefill_step, 0.0))

    # ---- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpu": self.gpu, "model": self.model, "tp": self.tp,
                "form_version": FORM_VERSION, "description": self.description,
                "coefficients": self.coefficients.to_dict(), "sources": self.sources, "fit": self.fit}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        version = data.get("form_version")
        if version != FORM_VERSION:
            raise ValueError(f"cost model {data.get('name')!r} has form_version={version!r}; this code reads "
                             f"{FORM_VERSION}. Re-run `tidal fit-cost-model`.")
        return cls(str(data["name"]), str(data["gpu"]), str(data["model"]), int(data["tp"]),
                   CostCoefficients.from_dict(dict(data["coefficients"])), description=str(data.get("description", "")),
                   sources=list(data.get("sources") or []), fit=dict(data.get("fit") or {}))

    @classmethod
    def load(cls, name_or_path: str | Path) -> CostModel:
        """A name under calibration/costmodels ("a100-llama70b-tp8") or a path to a YAML file."""
        import yaml

        path = Path(name_or_path)
        if path.suffix not in (".yaml", ".yml") and not path.exists():
            path = COSTMODEL_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"cost model {str(name_or_path)!r} not found; known names: {shipped_names()} "
                                    "(or pass a YAML path)")
        with path.open() as fh:
            return cls.from_dict(yaml.safe_load(fh))

    def __repr__(self) -> str:
        host = "" if self.include_host else ", device only"
        return f"CostModel({self.name!r}, {self.gpu}, {self.model}, tp={self.tp}{host})"


class _Precomputed:
    """The coefficients in seconds, per step, with the exponents the hot path needs."""

    __slots__ = ("ar_floor_p", "ar_inv_p", "ar_p", "ar_slope", "attn_decode", "attn_pair", "attn_token",
                 "decode_ctx", "gain", "graph_host_floor", "graph_host_floor_r", "host_floor", "host_floor_r",
                 "inv_overlap", "knee", "lin_floor_p", "lin_inv_p", "lin_p", "lin_slope", "overlap", "per_seq",
                 "prefill_step", "sharpness", "step")

    def __init__(self, c: CostCoefficients) -> None:
        ms = 1e-3
        scale = c.num_layers * c.linear_scale * ms  # the whole block is per layer, times L and s
        self.lin_p: float = c.linear_smoothness
        self.lin_inv_p: float = 1.0 / c.linear_smoothness
        self.lin_floor_p: float = (scale * c.linear_floor_ms) ** self.lin_p
        self.lin_slope: float = scale * c.linear_ms_per_token
        self.ar_p: float = c.allreduce_smoothness
        self.ar_inv_p: float = 1.0 / c.allreduce_smoothness
        self.ar_floor_p: float = (2.0 * scale * c.allreduce_floor_ms) ** self.ar_p  # two all-reduces per layer
        self.ar_slope: float = 2.0 * scale * c.allreduce_ms_per_token
        self.gain: float = c.large_step_gain
        self.knee: float = c.large_step_knee_tokens
        self.sharpness: float = c.large_step_sharpness
        self.attn_pair: float = c.attn_prefill_ms_per_pair * ms
        self.attn_token: float = c.attn_prefill_ms_per_token * ms
        self.attn_decode: float = c.attn_decode_ms_per_token * ms
        self.host_floor: float = c.host_floor_ms * ms
        self.graph_host_floor: float = self.host_floor if c.graph_host_floor_ms is None else c.graph_host_floor_ms * ms
        self.graph_host_floor_r: float = self.graph_host_floor ** c.host_overlap
        self.overlap: float = c.host_overlap
        self.inv_overlap: float = 1.0 / c.host_overlap
        self.host_floor_r: float = self.host_floor ** self.overlap
        self.step: float = c.step_ms * ms
        self.prefill_step: float = c.prefill_step_ms * ms
        self.per_seq: float = c.per_seq_ms * ms
        self.decode_ctx: float = c.decode_ctx_ms_per_token * ms


def _weighted_lstsq(rows: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Least squares for t = sum(c_i * x_i), rows (x_1..x_n, t) weighted by 1/t (normal equations)."""
    n = len(rows[0]) - 1
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    for row in rows:
        t = row[n]
        x = [v / t for v in row[:n]]
        for i in range(n):
            atb[i] += x[i]  # (t / t)
            for j in range(n):
                ata[i][j] += x[i] * x[j]
    return _solve(ata, atb)


def _solve(a: list[list[float]], b: list[float]) -> tuple[float, ...]:
    """Gauss-Jordan with partial pivoting (the systems here are 3x3 or 4x4)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            raise ValueError("service prior fit is singular")
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return tuple(m[i][n] / m[i][i] for i in range(n))
