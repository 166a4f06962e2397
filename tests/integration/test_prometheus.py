"""Every PromQL expression of the dashboards and alert rules, against a real Prometheus scraping a
real Serve run: it parses (Prometheus answers 400 to a parse error) and returns data.

A throwaway Prometheus (Debian's `prometheus`, `make prometheus`) listens on loopback with its
own config and storage, scrapes Ray's metrics export port every second and evaluates the shipped
rule file (k8s/prometheus/tidalserve-rules.yaml) every second. Load goes to the simulated A100
unit at /sim: one burst of long prompts, several times its capacity, so admission control
answers 429 and the rejection series exist; then a trickle keeps every counter moving while
Ray exports (about every 10 s) so rates and quantiles have values, not only series.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from ops import alerts, dashboards, promql
from ops.grafana_panels import expressions
from ops.targets import load_targets
from tests.integration.conftest import ENV_KEY, ROOT, ServeCluster, free_port, unit_state

pytestmark = pytest.mark.ray
RULE_FILE = ROOT / "k8s" / "prometheus" / "tidalserve-rules.yaml"
SIM_MODEL = "sim-llama-70b-a100"
GAP_RETRY_S = 30.0
TRICKLE: Counter[str] = Counter()  # the trickle's outcomes (status code or error), for failure messages
BURST: Counter[tuple[int, str | None]] = Counter()  # the burst's (status, refused by) outcomes
RULES: list[tuple[str | None, str | None]] = []  # each 429 of the burst: (x-tidal-refusal-reason, its body's code)

EMPTY_PANEL_QUERIES = {
    ("Preemptions by reason", "{{class}} {{reason}}"): "no request is preempted: the simulated A100 KV pool is "
                                                       "far larger than a short test fills",
    ("Engine errors by kind", "{{unit}} {{kind}}"): "no engine fails in a healthy run (the counter has no series "
                                                    "until the first error)",
    ("Units and autoscaling", "desired (policy)"): "the test configs run fixed num_replicas, so the tidalserve "
                                                   "autoscaling policy never runs and never sets its gauges",
    ("Units and autoscaling", "demand (policy)"): "as above: only set by the autoscaling policy (prod.yaml)",
}
EMPTY_SIGNALS = {
    ("TidalUnitDown", 0): "no unit vanished in the last 15 minutes",
    ("TidalEngineErrors", 0): "no engine error, so the counter has no series",
    ("TidalNoUnitsReporting", 0): "absent() is empty while units report: that is the healthy state",
}


@pytest.fixture(scope="module")
def prometheus(serve_cluster: ServeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (make prometheus)")
    work = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULE_FILE)],
              "scrape_configs": [{"job_name": "ray", "static_configs": [
                  {"targets": [f"127.0.0.1:{serve_cluster.metrics_port}"]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30, "prometheus ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _wait(ok: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no {what} after {timeout_s:.0f} s")


def _burst(base: str, n: int) -> list[tuple[int, str | None]]:
    """(status, where it was refused: the `x-tidal-refused-by` header) of each of `n` concurrent requests."""
    async def one(client: httpx.AsyncClient) -> tuple[int, str | None]:
        r = await client.post(f"{base}/sim/v1/completions", json={
            "model": SIM_MODEL, "prompt": "word " * 1500, "max_tokens": 16, "ignore_eos": True})
        if r.status_code == 429:
            RULES.append((r.headers.get("x-tidal-refusal-reason"), r.json()["error"]["code"]))
        return r.status_code, r.headers.get("x-tidal-refused-by")

    async def run() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
            return list(await asyncio.gather(*(one(client) for _ in range(n))))

    return asyncio.run(run())


def _trickle(base: str, stop: threading.Event, outcomes: Counter[str]) -> None:
    """Keep requests flowing until told to stop; a failed request is counted, not fatal (a thread
    that died on one connection error would leave the rate windows empty for the later tests)."""
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            try:
                r = client.post(f"{base}/sim/v1/completions", json={
                    "model": SIM_MODEL, "prompt": "word " * 200, "max_tokens": 8, "ignore_eos": True})
                outcomes[str(r.status_code)] += 1
                # A batch-class request (service_tier flex) moves the batch class's gauges and counter.
                r = client.post(f"{base}/sim/v1/completions", json={
                    "model": SIM_MODEL, "prompt": "word " * 100, "max_tokens": 4, "ignore_eos": True,
                    "service_tier": "flex"})
                outcomes[f"flex {r.status_code}"] += 1
                # The keyed application's per-key counters and its 401 counter move too.
                for key in (ENV_KEY, "tk-not-a-key"):
                    r = client.post(f"{base}/keyed/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                    json={"model": SIM_MODEL, "prompt": "word", "max_tokens": 2})
                    outcomes[f"keyed {r.status_code}"] += 1
            except httpx.HTTPError as e:
                outcomes[type(e).__name__] += 1
                time.sleep(0.2)


@pytest.fixture(scope="module")
def loaded(serve_cluster: ServeCluster, prometheus: str) -> Iterator[str]:
    base = serve_cluster.base_url
    burst = _burst(base, 120)
    BURST.update(burst)
    statuses = [status for status, _ in burst]
    assert 429 in statuses and 200 in statuses, burst
    httpx.post(f"{base}/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2},
               timeout=60)  # the local unit reports its gauges after its first request
    stop = threading.Event()
    threads = [threading.Thread(target=_trickle, args=(base, stop, TRICKLE), daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        # The burst's refusals are the unit's (`rejections`) or the front door's (`front_refusals`), or both.
        arriving = "sum(rate(ray_tidal_requests_arrived_total[1m])) > 0"
        rejections = "ray_tidal_rejections_total or ray_tidal_front_refusals_total"
        try:
            _wait(lambda: _query(prometheus, arriving) and _query(prometheus, rejections), 45,
                  "moving tidal series in Prometheus")
        except TimeoutError as e:  # say which series is missing, and what the load and the unit saw
            missing = [q for q in (arriving, rejections) if not _query(prometheus, q)]
            raise TimeoutError(f"{e}: missing {missing}; burst {dict(BURST)}; trickle {dict(TRICKLE)}; "
                               f"sim unit {unit_state('sim', check=False)}") from e
        yield prometheus
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        # Leave the shared simulated unit as the next test module expects it: drained, out of OVERLOAD.
        _wait(lambda: _settled(unit_state("sim")), 60, "the simulated unit to settle")


def _settled(state: dict[str, Any]) -> bool:
    return bool(state["num_requests"] == 0 and state["regime_name"] != "overload")


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, f"{r.status_code} {r.text[:300]} for {expr}"
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _check(prom: str, name: tuple[str, Any], expr: str, allowed_empty: dict[tuple[str, Any], str]) -> int:
    query = promql.substitute_grafana_vars(expr, rate_interval="1m", time_range="5m")
    result = _query(prom, query)  # parses, or fails here
    if name in allowed_empty:
        return 0
    # Ray's metrics agent drops a gauge it has not heard of for two export intervals (20 s); on a
    # loaded machine a late export leaves a short gap, so an empty answer is retried a while.
    deadline = time.monotonic() + GAP_RETRY_S
    while not result and time.monotonic() < deadline:
        time.sleep(1.0)
        result = _query(prom, query)
    if not result:
        present = {n: len(_query(prom, n)) for n in sorted(promql.metric_names(expr))}
        raise AssertionError(f"{name}: no data for {expr} (series per name: {present})")
    return len(result)


def test_every_dashboard_expression_parses_and_has_data(loaded: str) -> None:
    dash = dashboards.serving_dashboard(load_targets())
    legends = {t["expr"]: t["legendFormat"] for p in dash["panels"] for t in p.get("targets", [])}
    checked = [(title, legends[expr], expr) for title, expr in expressions(dash)]
    for title, legend, expr in checked:
        _check(loaded, (title, legend), expr, EMPTY_PANEL_QUERIES)
    assert len(checked) > 40
    # The `unit` variable lists every deployed unit (local, sim and keyed; each exports from its first request).
    _wait(lambda: len(httpx.get(f"{loaded}/api/v1/label/unit/values", params={"match[]": "ray_tidal_regime"},
                                timeout=10).json()["data"]) == 3, 30, "all three units in the unit variable")


def test_every_refusal_of_the_burst_is_counted_where_it_was_decided(loaded: str) -> None:
    # A request refused at the front door never reaches a unit: it is counted in
    # `front_refusals{where}` (the proxy's or the ingress's gate), a unit's refusal in its `rejections`.
    # (A 429 without the header would be Serve's own backpressure, counted by Serve's metrics, not these.)
    refused = Counter(where for (status, where), n in BURST.items() if status == 429 and where for _ in range(n))
    assert refused, dict(BURST)
    for where, n in refused.items():
        name = "ray_tidal_rejections_total" if where == "unit" else f'ray_tidal_front_refusals_total{{where="{where}"}}'
        deadline = time.monotonic() + GAP_RETRY_S  # Ray exports about every 10 s
        while (counted := sum(float(r["value"][1]) for r in _query(loaded, f"sum({name})"))) < n \
                and time.monotonic() < deadline:
            time.sleep(1.0)
        assert counted >= n, (where, n, counted, dict(BURST))


def test_every_refusal_of_the_burst_names_its_rule(loaded: str) -> None:
    # Wherever it was decided, a 429 says its rule in a header (what the gates in front learn from),
    # the same as its body's code.
    assert RULES and all(header == code and code for header, code in RULES), RULES


def test_latency_quantiles_have_values(loaded: str) -> None:
    dash = dashboards.serving_dashboard(load_targets())
    for title in ("Time to first token", "End-to-end latency", "Inter-token latency", "Batch size"):
        (panel,) = [p for p in dash["panels"] if p["title"] == title]
        for target in panel["targets"]:
            query = promql.substitute_grafana_vars(target["expr"], rate_interval="1m")
            # A quantile is NaN while its window holds no observation, and has no series at all while
            # Ray's agent skips an export; Ray exports about every 10 s and a busy machine can delay
            # one, so an empty or NaN answer is retried a while before it fails.
            deadline = time.monotonic() + GAP_RETRY_S
            result = _query(loaded, query)
            while not _one_finite(result) and time.monotonic() < deadline:
                time.sleep(1.0)
                result = _query(loaded, query)
            assert _one_finite(result), (title, target["legendFormat"], result, dict(TRICKLE))


def _one_finite(result: list[dict[str, Any]]) -> bool:
    return len(result) == 1 and math.isfinite(float(result[0]["value"][1]))


def test_every_alert_expression_parses_and_every_signal_has_data(loaded: str) -> None:
    rules = alerts.build_rules(load_targets())
    for rule in rules:
        _query(loaded, rule.expr())  # parses (an alert's own result is empty unless it fires)
        for i, condition in enumerate(rule.conditions):
            _check(loaded, (rule.name, i), condition.signal, EMPTY_SIGNALS)
    check = subprocess.run(["promtool", "check", "rules", str(RULE_FILE)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_prometheus_evaluates_the_shipped_rules_without_errors(loaded: str) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = httpx.get(f"{loaded}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    _wait(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in evaluated()), 10, "rule evaluations")
    rules = evaluated()
    assert {r["name"] for r in rules} == {r.name for r in alerts.build_rules(load_targets())}
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


def _query_over_gaps(prom: str, expr: str) -> list[dict[str, Any]]:
    """`_query`, an empty answer retried a while: Ray's agent leaves short gaps in gauges (see _check)."""
    deadline = time.monotonic() + GAP_RETRY_S
    result = _query(prom, expr)
    while not result and time.monotonic() < deadline:
        time.sleep(1.0)
        result = _query(prom, expr)
    return result


def test_serve_metric_names_exist_in_the_live_scrape(loaded: str) -> None:
    for name in promql.SERVE_METRICS:
        assert _query_over_gaps(loaded, f'count({{__name__="{name}"}})'), f"{name} is not exported by this Ray"
    healthy = _query_over_gaps(loaded, f'{promql.SERVE_REPLICA_HEALTHY}{{deployment="{promql.SERVE_DEPLOYMENT}"}}')
    units = {s["metric"]["unit"] for s in _query(loaded, "ray_tidal_regime")}
    assert units <= {s["metric"]["replica"] for s in healthy}  # Serve's replica id is our unit id
