"""Prometheus alert rules for tidalserve, generated from metric definitions and config targets.

Owns: `AlertRule` (a conjunction of `Condition`s: signal, comparison, threshold), the rule set
(`build_rules`), the rule-file form (`rule_groups`) shipped as k8s/prometheus/tidalserve-rules.yaml
and inside the PrometheusRule object. Signals are kept apart from thresholds so tests can ask a
live Prometheus whether each signal has data, not only whether the alert fires.

Paging follows symptoms (the TTFT error budget burning, no unit reporting); causes (sustained
overload, KV pressure, rejections, a unit lost) are warnings. Must not import ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ops import promql as Q
from ops.targets import Targets
from serve_app import metric_defs as M

GROUP_NAME = "tidalserve"
RUNBOOK = "docs/operations.md"
FAST_BURN = (("5m", "1h"), 14.4, "2m", "page")
"""2% of a 30-day budget in one hour (Google SRE workbook, multiwindow multi-burn-rate)."""
SLOW_BURN = (("30m", "6h"), 6.0, "15m", "ticket")
"""5% of a 30-day budget in six hours."""


@dataclass(frozen=True)
class Condition:
    signal: str
    op: str
    threshold: float

    def expr(self) -> str:
        return f"({self.signal}) {self.op} {self.threshold:g}"


@dataclass(frozen=True)
class AlertRule:
    name: str
    conditions: tuple[Condition, ...]
    for_: str
    severity: str
    summary: str
    description: str
    join: str = "and on()"
    labels: dict[str, str] = field(default_factory=dict)

    def expr(self) -> str:
        return f" {self.join} ".join(c.expr() for c in self.conditions)

    def to_rule(self) -> dict[str, object]:
        rule: dict[str, object] = {"alert": self.name, "expr": self.expr()}
        if self.for_ != "0m":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity, "service": "tidalserve", **self.labels}
        rule["annotations"] = {"summary": self.summary, "description": self.description,
                               "runbook_url": f"{RUNBOOK}#{self.name.lower()}"}
        return rule


def ttft_burn_rate(t: Targets, window: str) -> str:
    """Error-budget burn rate of the TTFT SLO over `window` (1 = spending exactly the budget)."""
    within = Q.fraction_within(M.TTFT, t.ttft_s, window=window)
    return f"(1 - ({within})) / {t.error_budget:g}"


def _burn_rule(t: Targets, name: str, spec: tuple[tuple[str, str], float, str, str]) -> AlertRule:
    (short, long), factor, for_, severity = spec
    return AlertRule(
        name, (Condition(ttft_burn_rate(t, short), ">", factor), Condition(ttft_burn_rate(t, long), ">", factor)),
        for_, severity,
        f"TTFT SLO error budget burning {factor:g}x too fast ({short} and {long} windows)",
        f"Requests over the {t.ttft_s:g} s TTFT target are {factor:g}x the error budget "
        f"({t.error_budget:.0%} of requests) over both the last {short} and {long}. "
        "Check the regime, rejections and units panels.")


def units_reporting() -> str:
    return Q.agg("count", (), Q.gauge(M.REGIME, match=""))


ROUTER = f'deployment="{Q.SERVE_DEPLOYMENT}"'
APP = ("application",)


def serve_router_target(group: tuple[str, ...] = ()) -> str:
    return Q.agg("sum", group, Q.selector(Q.SERVE_TARGET_REPLICAS, ROUTER))


def serve_router_healthy(group: tuple[str, ...] = ()) -> str:
    return Q.agg("sum", group, Q.selector(Q.SERVE_REPLICA_HEALTHY, ROUTER))


def _capacity_rules(t: Targets) -> list[AlertRule]:
    return [
        AlertRule("TidalOverloadSustained", (Condition(Q.gauge(M.REGIME, match=""), "==", t.overload_level),),
                  "10m", "warning", "Unit {{ $labels.unit }} in OVERLOAD for 10 minutes",
                  "The unit's scheduler has called OVERLOAD (load >= capacity, queue delay over the TTFT target or "
                  "KV nearly full) for 10 minutes: the autoscaler is not keeping up or is at max_replicas."),
        AlertRule("TidalKVCacheNearFull", (Condition(Q.gauge(M.KV_USAGE, match=""), ">", t.kv_alert),),
                  "5m", "warning", "Unit {{ $labels.unit }} KV cache {{ $value | humanizePercentage }} full",
                  f"KV-cache usage above {t.kv_alert:.0%} for 5 minutes: admissions stall on KV room and preemptions "
                  "(recompute) follow. Long prompts or outputs, or too few units."),
        AlertRule("TidalRejectionRateHigh",
                  (Condition(Q.refused_fraction(window="5m", match=""), ">", t.rejection_ratio),),
                  "10m", "warning", "{{ $value | humanizePercentage }} of requests rejected (429)",
                  f"Admission control turned away more than {t.rejection_ratio:.0%} of the requests offered for 10 "
                  "minutes, at the units or at the front door (too_long excluded: those are client errors). "
                  "Capacity is short of demand."),
    ]


def _unit_rules() -> list[AlertRule]:
    regime_now = Q.gauge(M.REGIME, match="")
    vanished = f"max by (unit) (max_over_time({M.REGIME.prom_name}[15m])) unless on (unit) {regime_now}"
    return [
        AlertRule("TidalUnitDown",
                  (Condition(vanished, ">=", 0), Condition(f"{units_reporting()} - {serve_router_target()}", "<", 0)),
                  "5m", "warning", "Serving unit {{ $labels.unit }} stopped reporting",
                  "The unit reported in the last 15 minutes but not now, and fewer units report than Serve's target "
                  "for the ServingUnit deployment (so this is not a scale-down). A crashed engine or lost GPU node; "
                  "Serve replaces the replica, which takes minutes for a 70B model."),
        AlertRule("TidalUnitsBelowTarget",
                  (Condition(f"{serve_router_healthy(APP)} - {serve_router_target(APP)}", "<", 0),),
                  "15m", "warning", "Fewer healthy ServingUnit replicas than Serve's target for 15 minutes",
                  "Serve wants more serving units than are healthy: a GPU node is not being provisioned, a placement "
                  "group cannot be placed (8 GPUs on one node), or replicas fail their health checks."),
        AlertRule("TidalEngineErrors",
                  (Condition(f"sum by (unit, kind) (increase({M.ENGINE_ERRORS.prom_name}[10m]))", ">", 0),),
                  "0m", "warning", "Engine failures on unit {{ $labels.unit }} ({{ $labels.kind }})",
                  "A TP worker died or a step timed out; the unit's in-flight requests got errors and the unit "
                  "was rebuilt."),
        AlertRule("TidalNoUnitsReporting", (Condition(f"absent({M.REGIME.prom_name})", "==", 1),),
                  "5m", "page", "No tidalserve unit reports metrics",
                  "No serving unit has exported metrics for 5 minutes: the service is down or the scrape is broken "
                  "(check the PodMonitor and the pods' metrics port)."),
    ]


def build_rules(t: Targets) -> list[AlertRule]:
    rules = [_burn_rule(t, "TidalTTFTBudgetBurnFast", FAST_BURN), _burn_rule(t, "TidalTTFTBudgetBurnSlow", SLOW_BURN)]
    rules += _capacity_rules(t)
    rules += _unit_rules()
    return rules


def rule_groups(t: Targets) -> dict[str, object]:
    """The rule file: `groups: [{name, rules}]` (also the PrometheusRule object's spec)."""
    return {"groups": [{"name": GROUP_NAME, "rules": [r.to_rule() for r in build_rules(t)]}]}


def signals(t: Targets) -> list[tuple[str, str]]:
    """(alert name, signal expression) for every condition of every rule."""
    return [(r.name, c.signal) for r in build_rules(t) for c in r.conditions]
