"""The decoder's shape, read once from a Hugging Face config.

Owns: `ModelConfig` (frozen) and `from_hf_config`, the one place that knows the spelling of HF
config fields across transformers 4.x (`rope_scaling`, `rope_theta`) and 5.x (`rope_parameters`).

Must not import: ray, serve_app (the model is independent of serving).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either config generation."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    theta = getattr(hf, "rope_theta", None)
    scaling: dict[str, Any] | None = None
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", theta)
        rope_type = params.get("rope_type", params.get("type", "default"))
        params["rope_type"] = rope_type
        scaling = None if rope_type == "default" else params
    return float(theta if theta is not None else 10000.0), scaling


def from_hf_config(hf: Any) -> ModelConfig:
    """Translate a transformers `PretrainedConfig` (Llama, Mistral, SmolLM2) into ours."""
    archs = list(getattr(hf, "architectures", None) or ["LlamaForCausalLM"])
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported (Llama-family models use silu)")
    num_heads = hf.num_attention_heads
    theta, scaling = _rope(hf)
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        sliding_window=getattr(hf, "sliding_window", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
        architecture=arch,
    )
