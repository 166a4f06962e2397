"""Dashboards and alert rules: generated from metric_defs (no metric name typed twice), SLO lines
and alert thresholds from the config, Grafana dashboard structure, `promtool check rules`, and
`tidal dashboards push` against a local HTTP stand-in for Grafana that records every call."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from ops import alerts, dashboards, grafana, promql
from ops.grafana_panels import GRID_WIDTH, expressions
from ops.targets import PROD_CONFIG, REPO_ROOT, load_targets
from serve_app import metric_defs as M
from tidal_cli import main as tidal

TARGETS = load_targets()
DASH = dashboards.serving_dashboard(TARGETS)
RULE_FILE = REPO_ROOT / "k8s" / "prometheus" / "tidalserve-rules.yaml"


def all_exprs() -> list[str]:
    return [e for _, e in expressions(DASH)] + [r.expr() for r in alerts.build_rules(TARGETS)]


def known_series() -> set[str]:
    names = {m.prom_name for m in M.ALL_METRICS}
    names |= {promql.hist_series(m, s) for m in M.ALL_METRICS if m.kind == "histogram" for s in ("bucket", "count",
                                                                                                  "sum")}
    return names | set(promql.SERVE_METRICS)


def test_every_series_comes_from_a_definition() -> None:
    used = set().union(*(promql.metric_names(e) for e in all_exprs()))
    assert used and used <= known_series(), used - known_series()


def test_no_tidal_metric_name_is_typed_in_ops_code() -> None:
    """Names live in serve_app/metric_defs.py only; ops code derives them from MetricDef objects."""
    for path in (REPO_ROOT / "serve_app" / "ops").glob("*.py"):
        literals = re.findall(r"[\"']((?:ray_)?tidal_[a-z_]+)", path.read_text())
        assert literals == [], f"{path.name} types metric names: {literals}"


def test_every_metric_is_on_the_dashboard() -> None:
    exprs = " ".join(e for _, e in expressions(DASH))
    missing = [m.name for m in M.ALL_METRICS if f"ray_{m.name}" not in exprs]
    assert missing == []


def test_dashboard_structure() -> None:
    assert DASH["schemaVersion"] == 39 and DASH["uid"] == dashboards.SERVING_UID
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["unit"]["definition"] == f"label_values({M.REGIME.prom_name}, {M.UNIT_TAG})"
    assert variables["unit"]["multi"] and variables["unit"]["allValue"] == ".*"
    ids = [p["id"] for p in DASH["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in DASH["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= GRID_WIDTH
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["description"] and panel["targets"]
    service_wide = {"TTFT error-budget burn rate", "Units and autoscaling"}  # what the alerts see: all units
    service_wide |= {"Requests by API key", "Tokens by API key", "Refused with 401"}  # ingress-side: no unit
    service_wide |= {"Queue time and predicted delay"}  # its proxy-to-ingress line: ingress-side, no unit
    service_wide |= {"Front door's aim"}  # the gates' own: they front every unit of an application
    unfiltered = [t for t, e in expressions(DASH) if "ray_tidal_" in e and 'unit=~"$unit"' not in e]
    assert set(unfiltered) == service_wide


def _panel(title: str, dash: dict[str, Any] = DASH) -> dict[str, Any]:
    (panel,) = [p for p in dash["panels"] if p["title"] == title]
    return panel


def _lines(panel: dict[str, Any]) -> list[float]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None]


def test_slo_lines_and_alert_thresholds_come_from_the_config(tmp_path: Path) -> None:
    prod = yaml.safe_load(PROD_CONFIG.read_text())
    admission = prod["applications"][0]["args"]["scheduler"]["admission"]
    assert _lines(_panel("Time to first token")) == [admission["target_ttft_s"]]
    assert _lines(_panel("Inter-token latency")) == [admission["target_tpot_s"]]
    changed = tmp_path / "prod.yaml"
    changed.write_text(PROD_CONFIG.read_text().replace("target_ttft_s: 1.0", "target_ttft_s: 2.0"))
    targets = load_targets(changed)
    assert _lines(_panel("Time to first token", dashboards.serving_dashboard(targets))) == [2.0]
    (burn,) = [r for r in alerts.build_rules(targets) if r.name == "TidalTTFTBudgetBurnFast"]
    assert 'le="2.0"' in burn.expr() and 'le="1.0"' not in burn.expr()


def test_rendering_does_not_import_ray() -> None:
    code = ("import sys; from ops import manifests, cli; manifests.render_tree(); "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_slo_target_must_be_a_bucket_boundary() -> None:
    with pytest.raises(ValueError, match="bucket boundary"):
        promql.fraction_within(M.TTFT, 0.9, window="5m")


def test_alert_rules() -> None:
    rules = {r.name: r for r in alerts.build_rules(TARGETS)}
    assert set(rules) >= {"TidalTTFTBudgetBurnFast", "TidalTTFTBudgetBurnSlow", "TidalOverloadSustained",
                          "TidalKVCacheNearFull", "TidalRejectionRateHigh", "TidalUnitDown"}
    fast = rules["TidalTTFTBudgetBurnFast"]
    assert [c.threshold for c in fast.conditions] == [14.4, 14.4]
    assert "[5m]" in fast.conditions[0].signal and "[1h]" in fast.conditions[1].signal
    overload = rules["TidalOverloadSustained"]
    assert overload.for_ == "10m" and overload.conditions[0].threshold == TARGETS.overload_level == 2
    assert rules["TidalKVCacheNearFull"].conditions[0].threshold == TARGETS.kv_alert
    assert all(r.severity in ("page", "ticket", "warning") for r in rules.values())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make prometheus)")
def test_promtool_checks_the_rule_file(tmp_path: Path) -> None:
    ok = subprocess.run(["promtool", "check", "rules", str(RULE_FILE)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"SUCCESS: {len(alerts.build_rules(TARGETS))} rules found" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULE_FILE.read_text().replace("max by (unit)", "max by (unit", 1))
    assert subprocess.run(["promtool", "check", "rules", str(broken)], capture_output=True).returncode != 0


ARRIVED = 'ray_tidal_requests_arrived_total{unit="u1"}'
UNIT_REJECTED = 'ray_tidal_rejections_total{unit="u1",reason="prefill_backlog"}'
TOO_LONG = 'ray_tidal_rejections_total{unit="u1",reason="too_long"}'
FRONT_REFUSED = 'ray_tidal_front_refusals_total{where="proxy",reason="prefill_backlog"}'


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make prometheus)")
@pytest.mark.parametrize(("series", "fires"), [
    ({ARRIVED: 60}, False),  # nothing refused: 0, not an empty answer
    ({ARRIVED: 60, UNIT_REJECTED: 6}, True),  # 0.1 of 1 req/s refused by the unit
    ({ARRIVED: 60, FRONT_REFUSED: 6}, True),  # 0.1 of 1.1 offered, all at the front door: no unit series at all
    ({ARRIVED: 60, UNIT_REJECTED: 2, FRONT_REFUSED: 2}, True),  # 4 of 62 per minute: 6.5%, neither alone over 5%
    ({ARRIVED: 60, FRONT_REFUSED: 2}, False),  # 2 of 62: 3.2%
    ({ARRIVED: 60, TOO_LONG: 30}, False),  # client errors are not capacity
])
def test_the_rejection_alert_counts_the_front_doors_refusals(tmp_path: Path, series: dict[str, int],
                                                              fires: bool) -> None:
    # Prometheus itself evaluates the shipped condition over synthetic counters (per-minute increments).
    rule = {r.name: r for r in alerts.build_rules(TARGETS)}["TidalRejectionRateHigh"]
    (cond,) = rule.conditions
    spec = {"evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": name, "values": f"0+{per_min}x30"} for name, per_min in series.items()],
        "promql_expr_test": [{"expr": f"({cond.signal}) > bool {cond.threshold}", "eval_time": "20m",
                              "exp_samples": [{"labels": "{}", "value": int(fires)}]}],
    }]}
    test_file = tmp_path / "test.yaml"
    test_file.write_text(yaml.safe_dump(spec))
    ok = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_grafana_variables_are_substituted() -> None:
    expr = promql.substitute_grafana_vars('rate(x{unit=~"$unit"}[$__rate_interval]) + rate(y[$__range])')
    assert expr == 'rate(x{unit=~".*"}[1m]) + rate(y[1h])'
    assert all("$" not in promql.substitute_grafana_vars(e) for e in all_exprs())


class _Grafana(BaseHTTPRequestHandler):
    """Records (method, path, auth, body); 404 for folders/datasources until they are created."""

    calls: list[tuple[str, str, str, Any]]
    created: set[str]
    fail: bool

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((method, self.path, self.headers.get("Authorization", ""), body))
        status, answer = self._answer(method, body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, method: str, body: Any) -> tuple[int, Any]:
        if self.fail:
            return 500, {"message": "boom"}
        if method == "GET":
            return (200, {"uid": self.path}) if self.path in self.created else (404, {"message": "not found"})
        if self.path == "/api/folders":
            self.created.add(f"/api/folders/{body['uid']}")
        if self.path == "/api/datasources":
            self.created.add(f"/api/datasources/uid/{body['uid']}")
        if self.path == "/api/dashboards/db":
            return 200, {"status": "success", "uid": body["dashboard"]["uid"], "url": "/d/x"}
        return 200, {"message": "ok"}

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_grafana() -> Iterator[tuple[str, type[_Grafana]]]:
    handler = type("Handler", (_Grafana,), {"calls": [], "created": set(), "fail": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_folder_datasource_and_dashboard(fake_grafana: tuple[str, type[_Grafana]]) -> None:
    url, handler = fake_grafana
    assert tidal(["dashboards", "push", "--url", url, "--token", "s3cret",
                  "--with-datasource", "http://prometheus:9090"]) == 0
    calls = [(m, p) for m, p, _, _ in handler.calls]
    assert calls == [("GET", "/api/folders/tidalserve"), ("POST", "/api/folders"),
                     ("GET", f"/api/datasources/uid/{grafana.DATASOURCE_UID}"), ("POST", "/api/datasources"),
                     ("POST", "/api/dashboards/db")]
    assert all(auth == "Bearer s3cret" for _, _, auth, _ in handler.calls)
    source = handler.calls[3][3]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    saved = handler.calls[4][3]
    assert saved["overwrite"] is True and saved["folderUid"] == "tidalserve"
    assert saved["dashboard"]["uid"] == dashboards.SERVING_UID and "id" not in saved["dashboard"]
    (var,) = [v for v in saved["dashboard"]["templating"]["list"] if v["type"] == "datasource"]
    assert var["current"]["value"] == grafana.DATASOURCE_UID
    handler.calls.clear()
    assert tidal(["dashboards", "push", "--url", url, "--token", "s3cret",
                  "--with-datasource", "http://prometheus:9090"]) == 0
    assert [(m, p) for m, p, _, _ in handler.calls][:4] == [
        ("GET", "/api/folders/tidalserve"), ("GET", f"/api/datasources/uid/{grafana.DATASOURCE_UID}"),
        ("PUT", f"/api/datasources/uid/{grafana.DATASOURCE_UID}"), ("POST", "/api/dashboards/db")]


def test_push_reports_a_failure(fake_grafana: tuple[str, type[_Grafana]], capsys: pytest.CaptureFixture[str]) -> None:
    url, handler = fake_grafana
    handler.fail = True
    assert tidal(["dashboards", "push", "--url", url, "--token", "t", "--folder", ""]) == 1
    assert "boom" in capsys.readouterr().err
    assert [p for _, p, _, _ in handler.calls] == ["/api/dashboards/db"]


def test_every_metric_is_in_the_metrics_reference() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    missing = [m.prom_name for m in M.ALL_METRICS if f"`{m.prom_name}" not in doc or m.description not in doc]
    assert not missing, f"docs/metrics.md does not list (or describes differently): {missing}"
