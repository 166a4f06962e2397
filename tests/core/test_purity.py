"""tidal_core is pure: importing it loads none of the heavy or async modules, and its
source never reads the wall clock or sleeps."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tidal_core

# `time` is loaded by the interpreter itself at start-up; the AST test below covers it.
FORBIDDEN_MODULES = ("ray", "torch", "transformers", "fastapi", "asyncio", "numpy")
CORE_DIR = Path(tidal_core.__file__).parent


def test_importing_core_loads_no_forbidden_module() -> None:
    code = ("import sys, tidal_core, tidal_core.scheduler; "
            f"print(','.join(m for m in {FORBIDDEN_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"tidal_core loaded: {out.stdout.strip()}"


def test_core_source_has_no_clock_or_sleep() -> None:
    for path in CORE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            bad = set(names) & {"time", "datetime", "asyncio", "threading", "ray", "torch", "transformers", "fastapi"}
            assert not bad, f"{path.name} imports {bad}"
