"""Application arguments: the `args:` block of a Serve config, validated strictly.

Owns: the pydantic models of `args` (`AppArgs` = engine + scheduler + ingress + streaming +
default_sampling + auth), the one place environment variables are read (`TIDAL_MODEL` overrides
`engine.model`, e.g. a model path mounted into a KubeRay pod; `TIDAL_API_KEYS` holds API keys, read
by each Ingress replica through `env_api_keys` so keys never travel in the deployment's
arguments), and the translation to the core's frozen `SchedulerConfig`.
Unknown keys are errors that name the key (Serve's own schema would accept them silently).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal_core import POLICIES, SchedulerConfig, preset
from tidal_core.config import ServicePrior

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineArgs(_Strict):
    model: str = Field(DEFAULT_MODEL, description="alias, HF checkpoint directory, HF id, or .gguf path")
    served_model_name: str | None = Field(None, description="name clients pass as `model` (default: `model`)")
    backend: Literal["hf", "sim"] = Field("hf", description="hf: the real model; sim: the cost model's step times")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel degree (GPUs per serving unit)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, ge=16)
    block_size: int = Field(16, ge=1)
    kv_cache_gb: float = Field(0.25, gt=0, description="CPU only: memory for the KV cache")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = Field(False, description="GPU: do not capture CUDA graphs")
    cpu_gemm: bool = Field(True, description="CPU float32: linears through pre-arranged weight layouts")
    cpu_attention: bool = Field(True, description="CPU float32: decode attention reads the KV blocks in place "
                                "(a C kernel); false: gather + SDPA")
    cpu_block_gemm: bool = Field(True, description="CPU float32, a model converted from a GGUF: linears of up to "
                                 "16 rows read the file's quantized blocks (the same weights, a C kernel)")
    cpu_fused_ops: bool = Field(True, description="CPU float32: RMSNorm (with the residual add), SiLU x up and "
                                "RoPE in one C call each instead of PyTorch's ~25 ops a layer")
    cpu_decode_layers: bool = Field(True, description="CPU float32 on GGUF blocks: a decode step's layers in one "
                                    "C call (the same kernels and bits, without the Python between them)")
    torch_threads: int | None = Field(None, ge=1, description="CPU: PyTorch threads per TP worker (default: of the "
                                      "CPUs the worker may use, both of two, else all less one, split over the "
                                      "TP ranks, at least 1)")
    compiled_graph: bool = Field(False, description="drive TP workers through a Ray Compiled Graph")
    step_socket: bool = Field(True, description="CPU workers without a compiled graph: steps reach TP workers on "
                              "the unit's node through a Unix socket instead of a Ray actor call (~3 ms less a step)")
    step_timeout_s: float = Field(60.0, gt=0, description="a step slower than this means a dead worker")
    cost_model: str | None = Field(None, description="sim backend: calibration/costmodels name or YAML path")
    sim_num_kv_blocks: int | None = Field(None, ge=1, description="sim backend: KV pool (default from the model)")

    @model_validator(mode="after")
    def _sim_needs_cost_model(self) -> EngineArgs:
        if self.backend == "sim" and not self.cost_model:
            raise ValueError("engine.backend 'sim' needs engine.cost_model (e.g. a100-llama70b-tp8)")
        return self

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model


class SchedulerArgs(_Strict):
    policy: str = Field("adaptive", description=f"one of {', '.join(POLICIES)}")
    max_batch_size: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    kv_watermark: float = Field(0.01, ge=0, lt=0.5)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes the unit "
                                        "computed before (false: every prompt is computed in full)")
    cuda_graph_buckets: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    load_tau_s: float = Field(10.0, gt=0)
    batching: dict[str, Any] = Field(default_factory=dict, description="overrides of core BatchingConfig")
    regime: dict[str, Any] = Field(default_factory=dict, description="overrides of core RegimeConfig")
    admission: dict[str, Any] = Field(default_factory=dict, description="overrides of core AdmissionConfig")
    step_sizing: dict[str, Any] = Field(default_factory=dict, description="overrides of core StepSizingConfig")

    @field_validator("enable_prefix_caching", mode="before")
    @classmethod
    def _a_switch(cls, value: Any) -> Any:
        words = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        if not isinstance(value, bool):
            raise ValueError(f"scheduler.enable_prefix_caching={value!r} is not a switch: write true, or false "
                             "to turn the prefix cache off")
        return value

    @model_validator(mode="after")
    def _known_policy(self) -> SchedulerArgs:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy={self.policy!r} is unknown; use one of {', '.join(POLICIES)}")
        return self


class IngressArgs(_Strict):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    request_timeout_s: float = Field(600.0, gt=0, description="a request running longer is aborted")


class StreamingArgs(_Strict):
    """Token streaming from the unit to the ingress (serve_app/engine_loop.py, StreamCoalescing)."""

    interval_s: float = Field(0.0, ge=0, le=2.0, description="with min_streams or more streams open, send a "
                              "stream's tokens at most this often (0: every token as it is made)")
    min_streams: int = Field(16, ge=1, description="open streams from which tokens are coalesced")


class DefaultSamplingArgs(_Strict):
    """What a request samples with when neither it nor the model's generation config says
    (serve_app/openai/sampling_defaults.py)."""

    temperature: float | None = Field(None, ge=0, le=2, description="default temperature (OpenAI's: 1)")
    top_p: float | None = Field(None, gt=0, le=1, description="default nucleus mass (OpenAI's: 1)")
    top_k: int | None = Field(None, ge=-1, description="default top-k (-1 or 0: off)")
    max_tokens: int | None = Field(None, ge=1, description="chat output tokens when a request sets neither "
                                   "max_tokens nor max_completion_tokens (None: whatever context is left)")


class KeyLimitArgs(_Strict):
    rpm: int | None = Field(None, ge=1, description="requests per minute (None: no limit)")
    tpm: int | None = Field(None, ge=1, description="prompt + generated tokens per minute (None: no limit)")


class AuthArgs(_Strict):
    """API keys and per-key limits, checked at the front end (serve_app/auth.py)."""

    required: bool = Field(False, description="every request needs a valid key (401 otherwise); needs "
                           "keys_file or TIDAL_API_KEYS. Keys in TIDAL_API_KEYS turn checking on even when false")
    keys_file: str | None = Field(None, description="file of keys (one per line or comma-separated), e.g. a "
                                  "mounted Kubernetes Secret; re-read every reload_period_s")
    reload_period_s: float = Field(2.0, gt=0, le=5.0, description="how often the keys file is re-read")
    open_paths: list[str] = Field(default_factory=lambda: ["/health"], description="paths served without a key")
    rpm: int | None = Field(None, ge=1, description="default requests per minute of each key")
    tpm: int | None = Field(None, ge=1, description="default tokens per minute of each key")
    per_key: dict[str, KeyLimitArgs] = Field(default_factory=dict, description="limits by key id (key-<sha256 "
                                             "prefix>), replacing rpm/tpm for that key")

    @model_validator(mode="after")
    def _ids_not_keys(self) -> AuthArgs:
        bad = [k for k in self.per_key if not (k.startswith("key-") and len(k) == 16)]
        if bad:
            raise ValueError(f"auth.per_key is keyed by key id ('key-' + 12 hex digits, as logged), not by key: "
                             f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} do not look like one")
        return self


class AppArgs(_Strict):
    engine: EngineArgs = Field(default_factory=EngineArgs)
    scheduler: SchedulerArgs = Field(default_factory=SchedulerArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    streaming: StreamingArgs = Field(default_factory=StreamingArgs)
    default_sampling: DefaultSamplingArgs = Field(default_factory=DefaultSamplingArgs)
    auth: AuthArgs = Field(default_factory=AuthArgs)


def load_app_args(raw: dict[str, Any] | None, environ: dict[str, str] | None = None) -> AppArgs:
    """Validate `args`; `TIDAL_MODEL` (read here, once) overrides engine.model."""
    env = os.environ if environ is None else environ
    data = dict(raw or {})
    if env.get("TIDAL_MODEL"):
        data["engine"] = {**dict(data.get("engine") or {}), "model": env["TIDAL_MODEL"]}
    return AppArgs.model_validate(data)


def env_api_keys(environ: dict[str, str] | None = None) -> list[str]:
    """The keys in `TIDAL_API_KEYS` (comma- or newline-separated), read in the Ingress replica."""
    from serve_app.api_keys import parse_keys

    env = os.environ if environ is None else environ
    return parse_keys(env.get("TIDAL_API_KEYS", ""))


def _replace(obj: Any, overrides: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(obj)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"scheduler.{where} has unknown key(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(obj, **overrides)


def scheduler_config(args: SchedulerArgs, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                     service_prior: ServicePrior | None = None) -> SchedulerConfig:
    """The core config of one unit: the preset for `policy`, sized by the engine, then overrides."""
    base = SchedulerConfig(
        max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_kv_blocks,
        kv_watermark=args.kv_watermark, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        cuda_graph_buckets=tuple(args.cuda_graph_buckets), load_tau_s=args.load_tau_s,
        service_prior=service_prior or ServicePrior(),
    )
    cfg = preset(args.policy, base)
    return dataclasses.replace(cfg, batching=_replace(cfg.batching, args.batching, "batching"),
                               regime=_replace(cfg.regime, args.regime, "regime"),
                               admission=_replace(cfg.admission, args.admission, "admission"),
                               step_sizing=_replace(cfg.step_sizing, args.step_sizing, "step_sizing"))
