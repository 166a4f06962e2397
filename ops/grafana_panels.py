"""Grafana dashboard JSON building blocks (schemaVersion 39): panels, variables, layout.

Owns: plain-dict constructors for the panel types the tidalserve dashboards use (time series,
state timeline, stat, row), the `datasource` and query template variables, and a layout pass
that assigns panel ids and grid positions. Knows nothing about tidalserve metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
PANEL_HEIGHT = 8

Panel = dict[str, Any]


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


def _targets(targets: list[Target]) -> list[dict[str, Any]]:
    return [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend,
             "range": True, "editorMode": "code"} for i, t in enumerate(targets)]


def _thresholds(lines: tuple[float, ...]) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    colors = ("orange", "red")
    steps += [{"color": colors[min(i, len(colors) - 1)], "value": v} for i, v in enumerate(sorted(lines))]
    return {"mode": "absolute", "steps": steps}


def timeseries(title: str, description: str, targets: list[Target], unit: str, *,
               lines: tuple[float, ...] = (), min_value: float | None = 0, width: int = 12) -> Panel:
    """A time series; `lines` are drawn as dashed threshold lines (SLO targets, alert marks)."""
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False,
                              "thresholdsStyle": {"mode": "dashed" if lines else "off"}}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "thresholds": _thresholds(lines)}
    if min_value is not None:
        defaults["min"] = min_value
    return {"type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": _targets(targets), "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "_width": width}


def state_timeline(title: str, description: str, targets: list[Target], states: dict[int, tuple[str, str]],
                   *, width: int = 12) -> Panel:
    """Discrete states over time; `states` maps a value to (text, colour)."""
    mappings = [{"type": "value", "options": {str(v): {"text": text, "color": color, "index": i}}}
                for i, (v, (text, color)) in enumerate(sorted(states.items()))]
    defaults = {"mappings": mappings, "color": {"mode": "thresholds"}, "thresholds": _thresholds(()),
                "custom": {"fillOpacity": 80, "lineWidth": 0}}
    return {"type": "state-timeline", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": _targets(targets), "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"mergeValues": True, "showValue": "auto", "rowHeight": 0.9,
                        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
            "_width": width}


def stat(title: str, description: str, targets: list[Target], unit: str, *, good_above: float,
         width: int = 6) -> Panel:
    """A single number, red below `good_above` (an SLO objective), green at or above."""
    thresholds = {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                {"color": "green", "value": good_above}]}
    return {"type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": _targets(targets),
            "fieldConfig": {"defaults": {"unit": unit, "decimals": 2, "thresholds": thresholds,
                                         "color": {"mode": "thresholds"}}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "area", "textMode": "auto"},
            "_width": width}


def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [], "includeAll": False,
            "multi": False}


def query_variable(name: str, label: str, metric: str, label_name: str) -> dict[str, Any]:
    """A multi-select variable over the values of `label_name` on `metric` ("All" matches `.*`)."""
    definition = f"label_values({metric}, {label_name})"
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": definition, "query": {"query": definition, "refId": "StandardVariableQuery"},
            "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0, "options": [],
            "regex": ""}


def layout(sections: list[tuple[str, list[Panel]]]) -> list[Panel]:
    """Rows of panels, left to right, wrapping at the grid width; assigns ids and gridPos."""
    out: list[Panel] = []
    y = 0
    next_id = 1
    for title, panels in sections:
        out.append({"type": "row", "title": title, "collapsed": False, "id": next_id, "panels": [],
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        next_id += 1
        y += 1
        x = 0
        for panel in panels:
            width = panel.pop("_width")
            if x + width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            out.append({**panel, "id": next_id, "gridPos": {"h": PANEL_HEIGHT, "w": width, "x": x, "y": y}})
            next_id += 1
            x += width
        y += PANEL_HEIGHT
    return out


def dashboard(uid: str, title: str, description: str, variables: list[dict[str, Any]],
              sections: list[tuple[str, list[Panel]]], tags: list[str]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": tags, "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "fiscalYearStartMonth": 0,
        "liveNow": False, "weekStart": "", "links": [],
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables},
        "panels": layout(sections),
    }


def expressions(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel (rows included)."""
    found: list[tuple[str, str]] = []
    for panel in dash["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            found += [(sub["title"], t["expr"]) for t in sub.get("targets", [])]
    return found
