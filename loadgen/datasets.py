"""Where the shipped trace and rate files live, and their short names.

Owns the one place that turns a name ("azure-conv", "m-large") into a file under the repository's
`data/` folder (a copy of public data; each folder has SOURCE.md). Every function that reads one
takes an explicit path too, so tests and users can point elsewhere.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

from pathlib import Path

from tidal_data import data_dir

# The installed data folder (a source checkout's data/, or $TIDAL_DATA_DIR).
DATA_DIR = data_dir()

# Real per-request traces shipped in data/, by short name.
TRACE_FILES: dict[str, str] = {
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "mooncake-fast25/conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake-fast25/synthetic_trace.jsonl",
}

# ServeGen per-10-minute aggregate rate files, by model column name.
SERVEGEN_RATE_FILES: dict[str, str] = {
    "m-large": "servegen/derived/servegen_language_m-large_aggregate.csv",
    "m-mid": "servegen/derived/servegen_language_m-mid_aggregate.csv",
    "m-small": "servegen/derived/servegen_language_m-small_aggregate.csv",
    "deepseek-r1": "servegen/derived/servegen_reason_deepseek-r1_aggregate.csv",
    "mm-image": "servegen/derived/servegen_multimodal_mm-image_aggregate.csv",
}

SERVEGEN_PROFILE_FILE = "servegen/derived/servegen_hour_of_day_profile.csv"


def data_path(relative: str, data_dir: Path | str | None = None) -> Path:
    """A file under the data folder; a clear error when the copy is missing."""
    path = Path(data_dir if data_dir is not None else DATA_DIR) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the repository's data/ folder ships it (see data/README.md); "
                                "set TIDAL_DATA_DIR to use another copy")
    return path


def trace_file(name: str, data_dir: Path | str | None = None) -> Path:
    if name not in TRACE_FILES:
        raise KeyError(f"unknown trace {name!r}; known: {', '.join(sorted(TRACE_FILES))}")
    return data_path(TRACE_FILES[name], data_dir)


def servegen_rate_file(model: str, data_dir: Path | str | None = None) -> Path:
    if model not in SERVEGEN_RATE_FILES:
        raise KeyError(f"unknown ServeGen model {model!r}; known: {', '.join(SERVEGEN_RATE_FILES)}")
    return data_path(SERVEGEN_RATE_FILES[model], data_dir)
