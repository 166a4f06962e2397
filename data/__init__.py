"""The shipped data, installed as the package `tidal_data` (this folder, mapped in pyproject.toml).

Owns: where the copies of public traces and GPU calibration data live, for a source checkout
and for a non-editable install alike (`importlib.resources`), and the one override: the
environment variable `TIDAL_DATA_DIR` names another folder of the same layout. Every reader
also takes an explicit folder (`--data-dir`), so tests and users can point elsewhere.

Must not import anything of the project: it is the bottom of the picture beside tidal_core.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

ENV_VAR = "TIDAL_DATA_DIR"


def data_dir() -> Path:
    """The data folder: `$TIDAL_DATA_DIR` when set, else the installed copy."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override)
    return Path(str(resources.files(__name__)))
