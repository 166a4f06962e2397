"""A non-editable install works: the wheel of this repository carries every module, the shipped data
(`tidal_data`) and the cost models, and once installed on its own it runs `tidal simulate` from its
own files and builds the Serve application of configs/local.yaml as `serve run` does.

The installed copy must not see this source tree: the wheel goes into a fresh folder
(`pip install --target`), and the check runs in `python -S` (no `site`, so the editable install's
`.pth` finder is never registered) with only that folder and the virtualenv's site-packages (for
ray, numpy, ...) on PYTHONPATH, from a working directory outside the repository. An audit hook
records every file the installed copy opens. Nothing is downloaded: pip runs with `--no-index`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tidal_cli import main as tidal

ROOT = Path(__file__).resolve().parents[1]
SIMULATE = ["simulate", "--trace", "azure-conv", "--policy", "adaptive", "--hours", "0.05", "--quiet",
            "--no-requests"]
TRACE = "tidal_data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
COST_MODEL = "calibration/costmodels/a100-llama70b-tp8.yaml"

# Runs inside the installed copy. argv: report path, install folder, Serve config path.
DRIVER = '''
import importlib, json, os, runpy, sys
report_path, site_dir, config_path = sys.argv[1:4]
opened = []
sys.addaudithook(lambda event, args: opened.append(os.path.abspath(os.fsdecode(args[0])))
                 if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None)
import calibration.cost_model, tidal_core, tidal_data
report = {
    "finders": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
    "editable_modules": [m for m in sys.modules if "editable" in m],
    "tidal_core": tidal_core.__file__, "data_dir": str(tidal_data.data_dir()),
    "costmodel_dir": str(calibration.cost_model.COSTMODEL_DIR),
}
sys.argv = ["tidal", *json.loads(os.environ["SIMULATE_ARGS"])]
try:
    runpy.run_path(os.path.join(site_dir, "bin", "tidal"), run_name="__main__")
except SystemExit as exit:
    report["simulate_exit"] = exit.code
import yaml
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from serve_app.config_check import check_serve_config
with open(config_path) as f:
    config = yaml.safe_load(f)
spec = config["applications"][0]
app = call_user_app_builder_with_args_if_necessary(import_attr(spec["import_path"]), spec["args"])
report["app"] = type(app).__name__
report["app_module"] = importlib.import_module("serve_app.app").__file__
report["config_errors"] = check_serve_config(config)
report["opened"] = opened
with open(report_path, "w") as f:
    json.dump(report, f)
'''


def _copy_source(dst: Path) -> None:
    """What a fresh clone holds for packaging: pyproject's modules and package folders, README."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dst.mkdir()
    for name in ["pyproject.toml", "README.md", *(f"{m}.py" for m in setup["py-modules"])]:
        shutil.copy2(ROOT / name, dst / name)
    for top in sorted({p.split(".")[0] for p in setup["packages"]}):
        folder = setup.get("package-dir", {}).get(top, top)
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _pip(*args: str | Path) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository built into a wheel and installed into a fresh folder; returns the temp root."""
    tmp = tmp_path_factory.mktemp("install")
    _copy_source(tmp / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "dist", tmp / "src")
    (wheel,) = (tmp / "dist").glob("tidalserve-*.whl")
    _pip("install", "--no-deps", "--no-index", "--no-compile", "--target", tmp / "site", wheel)
    return tmp


@pytest.fixture(scope="module")
def report(install: Path) -> dict[str, Any]:
    run = install / "run"
    run.mkdir()
    (run / "driver.py").write_text(DRIVER)
    shutil.copy2(ROOT / "configs" / "local.yaml", run / "local.yaml")  # the user's config, not the repo's
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "TIDAL_DATA_DIR"}
    env |= {"PYTHONPATH": os.pathsep.join([str(install / "site"), *site_packages]), "PYTHONNOUSERSITE": "1",
            "SIMULATE_ARGS": json.dumps([*SIMULATE, "--out", str(run / "out")])}
    out = subprocess.run([sys.executable, "-S", "driver.py", "report.json", str(install / "site"), "local.yaml"],
                         cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads((run / "report.json").read_text())
    return result


def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_wheel_carries_every_module_the_data_and_the_cost_models(install: Path) -> None:
    (wheel,) = (install / "dist").glob("tidalserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    src = install / "src"
    expected = {f"{m}.py" for m in setup["py-modules"]}
    for top in {p.split(".")[0] for p in setup["packages"]}:
        folder = src / setup.get("package-dir", {}).get(top, top)
        shipped = [*folder.rglob("*.py"), *folder.glob("costmodels/*.yaml")]
        if top == "tidal_data":
            shipped = [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        expected |= {"/".join((top, *p.relative_to(folder).parts)) for p in shipped}
    assert TRACE in expected and COST_MODEL in expected and len(expected) > 100
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    entry_points = (install / "site" / "tidalserve-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "tidal = tidal_cli:main" in entry_points


def test_installed_copy_does_not_see_the_source_tree(install: Path, report: dict[str, Any]) -> None:
    site = install / "site"
    assert not any("Editable" in f for f in report["finders"]) and not report["editable_modules"]
    assert _inside(report["tidal_core"], site)
    assert Path(report["data_dir"]).resolve() == (site / "tidal_data").resolve()
    assert Path(report["costmodel_dir"]).resolve() == (site / "calibration" / "costmodels").resolve()
    assert _inside(report["app_module"], site)
    venv = Path(sys.prefix)
    from_repo = sorted({p for p in report["opened"] if _inside(p, ROOT) and not _inside(p, venv)})
    assert not from_repo, f"the installed copy read files of the source tree: {from_repo[:10]}"


def test_installed_tidal_simulate_reads_the_shipped_trace_and_cost_model(install: Path, report: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    assert report["simulate_exit"] == 0
    opened = {Path(p).resolve() for p in report["opened"]}
    site = install / "site"
    assert (site / TRACE).resolve() in opened
    assert (site / COST_MODEL).resolve() in opened
    summary = json.loads((install / "run" / "out" / "summary.json").read_text())
    assert summary["adaptive"]["arrived"] > 100 and summary["adaptive"]["completed"] > 0
    # The same command from the source tree gives the same numbers.
    assert tidal([*SIMULATE, "--out", str(tmp_path / "source")]) == 0
    assert json.loads((tmp_path / "source" / "summary.json").read_text()) == summary


def test_installed_copy_builds_the_local_serve_application(report: dict[str, Any]) -> None:
    assert report["app"] == "Application"
    assert report["config_errors"] == []
