"""Run a piece of benchmark code in another checkout's interpreter and read its result.

`json_from_tree(tree, code, *args)`: `python -c code args...` with `tree` as the working directory
and on `PYTHONPATH`, so `tidal_core`, `loadgen`... are that checkout's; the code prints its
result as JSON on its last line. The A/B scripts (scheduler_ab.py, scheduler_parts.py,
prefix_cache_cycle.py) time this tree and a baseline checkout side by side with it, each part in
a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def json_from_tree(tree: Path, code: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
