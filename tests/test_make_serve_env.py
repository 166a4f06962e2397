"""The benchmarks that start a dev server start the one `make serve` starts.

`make serve` runs `serve run configs/local.yaml` with environment assignments in its recipe
(serve_app/cluster_env.py: the front gate in Serve's proxy, Serve's data plane over gRPC);
benchmarks/vs_vllm_cpu.py and benchmarks/startup_ab.py set `MAKE_SERVE_ENV` instead. If the two
drift apart, the benchmarks measure a server no user runs.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.vs_vllm_cpu import MAKE_SERVE_ENV
from serve_app.cluster_env import CLUSTER_ENV

ROOT = Path(__file__).resolve().parents[1]


def serve_recipe_env() -> dict[str, str]:
    """The `KEY=VALUE` words before `serve run` in the Makefile's serve target."""
    lines = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()  # continued lines joined
    start = next(i for i, line in enumerate(lines) if line.startswith("serve:"))
    recipe = next(line for line in lines[start + 1:] if line.startswith("\t") and "serve run" in line)
    words = recipe.split("serve run")[0].split()
    return dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S+", w))


def test_benchmarks_set_what_the_makefile_sets_for_make_serve() -> None:
    assert serve_recipe_env() == MAKE_SERVE_ENV
    assert serve_recipe_env() == CLUSTER_ENV  # every variable the test and benchmark clusters set
    assert MAKE_SERVE_ENV  # the recipe sets the proxy gate; an empty match would prove nothing
