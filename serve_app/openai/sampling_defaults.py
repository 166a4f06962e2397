"""What a request samples with when it does not say: the served model's defaults.

Owns: `SamplingDefaults` (temperature, top_p, top_k, and where each came from) and
`resolve_sampling_defaults`. Per field, in order: the model's own generation config
(`generation_config.json` in its checkpoint, when it sets the field), then the serve config's
`default_sampling`, then OpenAI's defaults (temperature 1, top_p 1, no top-k). A request's own
values always win over all of these (the server applies them field by field).

`max_tokens` comes from the serve config only: the output length a chat request gets when it
sets neither `max_tokens` nor `max_completion_tokens` (None: whatever context is left, as
OpenAI and vLLM do). A small model can loop without ever sampling its end token, and on a CPU
the rest of a 2,048-token context is minutes; the cap bounds that (`finish_reason: "length"`).

A small model sampled at temperature 1 rambles ("Belgium, a bastinted country..." for the
README's question); its authors usually ship a lower temperature in the generation config, and
where they do not, the serve config says what a newcomer's first request gets.

Must not import: ray, torch, transformers, fastapi.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
OPENAI_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int | None = None  # chat output when the request sets none (None: the context left)
    sources: Mapping[str, str] = field(default_factory=dict)  # field -> "model", "config" or "openai"

    def describe(self) -> str:
        fields = [f"{name}={getattr(self, name)} ({self.sources.get(name, 'openai')})" for name in OPENAI_DEFAULTS]
        return ", ".join([*fields, f"max_tokens={self.max_tokens or 'context left'}"])


def _valid(name: str, value: Any) -> float | int | None:
    """The value if it is a usable default for `name`, else None (a bad file is ignored, not fatal)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if name == "temperature":
        return float(value) if 0.0 <= value <= 2.0 else None
    if name == "top_p":
        return float(value) if 0.0 < value <= 1.0 else None
    if name == "top_k":
        k = int(value)
        return (-1 if k == 0 else k) if k == value and k >= -1 else None
    return None


def read_generation_config(model_dir: str | Path | None) -> dict[str, float | int]:
    """The sampling fields a checkpoint's `generation_config.json` sets (none: {})."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        logger.warning("ignoring unreadable %s", path, exc_info=True)
        return {}
    if not isinstance(raw, dict):
        return {}
    found: dict[str, float | int] = {}
    for name in OPENAI_DEFAULTS:
        if name in raw:
            value = _valid(name, raw[name])
            if value is None:
                logger.warning("ignoring %s=%r in %s (out of range)", name, raw[name], path)
            else:
                found[name] = value
    return found


def resolve_sampling_defaults(model: Mapping[str, Any], config: Mapping[str, Any]) -> SamplingDefaults:
    """Per field: the model's generation config, else the serve config, else OpenAI's default."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, fallback in OPENAI_DEFAULTS.items():
        for source, table in (("model", model), ("config", config)):
            value = _valid(name, table.get(name))
            if value is not None:
                values[name], sources[name] = value, source
                break
        else:
            values[name], sources[name] = fallback, "openai"
    cap = config.get("max_tokens")
    max_tokens = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 else None
    return SamplingDefaults(float(values["temperature"]), float(values["top_p"]), int(values["top_k"]), max_tokens,
                            sources)
