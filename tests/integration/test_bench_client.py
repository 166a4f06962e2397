"""A benchmark client we did not write, against `serve run configs/local.yaml` as a user starts it.

NVIDIA's AIPerf (installed by `make aiperf` into its own virtualenv, `.venv-aiperf`: its
dependency tree is its own) runs the workload of the dev-server issue, streaming chat with 128
prompt tokens and 32 output tokens (`ignore_eos`) at concurrency 8, and must see every request
succeed; then a burst at concurrency 64 must be queued and served, not refused (local.yaml's
admission mode is `protect`). Offline, AIPerf takes its tokenizer only as a hub id found in the
Hugging Face cache, so the served model's tokenizer files are laid out as such an entry under a
temporary HF_HOME.

This file sorts before the other integration tests on purpose: it starts its own Ray instance
(through `serve run`), which is gone before the shared pytest cluster of conftest.py starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ROOT, free_port, wait_healthy

pytestmark = pytest.mark.ray
MODEL = "smollm2-135m-instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json", "special_tokens_map.json")


def aiperf_binary() -> Path | None:
    path = Path(os.environ.get("TIDAL_AIPERF", ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    return path if path.exists() else None


def hub_cache_with_tokenizer(home: Path) -> Path:
    """An HF_HOME whose hub cache holds the served model's tokenizer under its hub id."""
    from actors.model_loader import prepare

    source = Path(prepare(MODEL))
    entry = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    revision = "0" * 40
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, snapshot / name)
    return home


@pytest.fixture(scope="module")
def served_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`serve run` on configs/local.yaml, changed only to listen on a free loopback port."""
    work = tmp_path_factory.mktemp("serve-run")
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"].update(host="127.0.0.1", port=port)
    path = work / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "HF_HUB_OFFLINE": "1"}
    serve = Path(sys.executable).parent / "serve"
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen([str(serve), "run", str(path)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 420)
        yield url
    finally:
        from benchmarks.vs_vllm_cpu import stop_server

        stop_server(proc)  # SIGTERM: serve run shuts Serve and its Ray instance down
        log.close()


@pytest.mark.timeout(1800)  # the server's start-up counts here: minutes on a busy shared box
def test_aiperf_at_concurrency_8_sees_no_failure(served_local: str, tmp_path: Path) -> None:
    aiperf = aiperf_binary()
    if aiperf is None:
        pytest.skip("AIPerf is not installed: run `make aiperf` (make test does) or set TIDAL_AIPERF")
    out = tmp_path / "aiperf"
    env = {**os.environ, "HF_HOME": str(hub_cache_with_tokenizer(tmp_path / "hf")), "HF_HUB_OFFLINE": "1"}
    cmd = [str(aiperf), "profile", "--model", MODEL, "--tokenizer", HUB_ID, "--url", served_local,
           "--endpoint-type", "chat", "--streaming", "--concurrency", "8", "--request-count", "16",
           "--synthetic-input-tokens-mean", "128", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", "32", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [], report["error_summary"]
    assert report["request_count"]["avg"] == 16 and report["request_error_rate"]["avg"] == 0.0
    # Every request made its 32 tokens, as the server's own usage says.
    assert report["total_usage_completion_tokens"]["avg"] == 16 * 32


@pytest.mark.timeout(1200)
def test_a_burst_of_64_is_queued_and_served_not_refused(served_local: str) -> None:
    from actors.model_loader import load_tokenizer, prepare
    from benchmarks.chat_load import Workload, fixed_length_prompts, run_load

    workload = Workload(input_tokens=64, output_tokens=4, concurrency=64, num_requests=64)
    prompts = fixed_length_prompts(load_tokenizer(prepare(MODEL)), workload.input_tokens, workload.num_requests)
    result = asyncio.run(run_load(served_local, MODEL, prompts, workload))
    assert not result.failures, result.summary()
    assert len(result.ttft_s) == 64 and result.output_tokens == 64 * 4
