"""PromQL built from metric definitions: the only place dashboards and alerts get series names.

Owns: small expression builders over `serve_app.metric_defs.MetricDef` (rates, quantiles,
fractions under a histogram bound), the names of the Ray Serve metrics the dashboards use
(Ray's own, verified against a live scrape in tests/integration/test_prometheus.py), and the
substitution of Grafana variables for tools that talk to Prometheus directly.

Must not import ray: dashboards and alert rules are generated on machines without it.
"""

from __future__ import annotations

import re

from serve_app.metric_defs import ARRIVALS, FRONT_REFUSALS, REJECTIONS, UNIT_TAG, WHERE_TAG, MetricDef

RATE = "$__rate_interval"
"""Grafana's rate window (four scrape intervals at least): panels never hard-code one."""
UNIT_FILTER = f'{UNIT_TAG}=~"$unit"'
"""The dashboards' `unit` template variable (multi-select, `.*` for All)."""
SERVE_DEPLOYMENT = "ServingUnit"
"""The Serve deployment whose replicas are serving units (serve_app/app.py)."""

# Ray Serve's own metrics (Ray 2.60 names; Ray prefixes `ray_`, counters gain `_total`).
SERVE_REPLICA_HEALTHY = "ray_serve_deployment_replica_healthy"
"""Per replica (label `replica`, equal to tidalserve's `unit`): 1 healthy, 0 unhealthy or stopped."""
SERVE_TARGET_REPLICAS = "ray_serve_autoscaling_target_replicas"
"""Replicas Serve is driving a deployment to (after the policy and min/max bounds)."""
SERVE_HTTP_REQUESTS = "ray_serve_num_http_requests_total"
"""Requests seen by Serve's HTTP proxies, by `application`, `route`, `status_code`."""
SERVE_METRICS = (SERVE_REPLICA_HEALTHY, SERVE_TARGET_REPLICAS, SERVE_HTTP_REQUESTS)


def selector(name: str, *matchers: str) -> str:
    """`name{m1,m2}`; empty matchers are dropped."""
    kept = [m for m in matchers if m]
    return f"{name}{{{','.join(kept)}}}" if kept else name


def le_label(bound: float) -> str:
    """The `le` label value Ray exports for a histogram boundary (Python float repr: "1.0", "0.1")."""
    return repr(float(bound))


def _need(defn: MetricDef, kind: str) -> None:
    if defn.kind != kind:
        raise ValueError(f"{defn.name} is a {defn.kind}, not a {kind}")


def hist_series(defn: MetricDef, suffix: str) -> str:
    """`ray_<name>_bucket|_count|_sum` of a histogram, derived from its definition."""
    if suffix not in ("bucket", "count", "sum"):
        raise ValueError(f"unknown histogram series suffix {suffix!r}")
    return defn.prom_bucket.removesuffix("_bucket") + f"_{suffix}"


def agg(op: str, labels: tuple[str, ...], inner: str) -> str:
    """`op(inner)` or `op by (labels) (inner)`."""
    return f"{op} by ({', '.join(labels)}) ({inner})" if labels else f"{op}({inner})"


def counter_rate(defn: MetricDef, *, group: tuple[str, ...] = (), window: str = RATE, match: str = UNIT_FILTER,
                 extra: str = "") -> str:
    """`sum by (group) (rate(counter{match}[window]))`."""
    _need(defn, "counter")
    return agg("sum", group, f"rate({selector(defn.prom_name, match, extra)}[{window}])")


# A request is refused either by a unit's admission (`tidal_rejections`, counted with the unit's
# arrivals) or at the front door before it reaches one (`tidal_front_refusals`, no unit label: it
# shows whichever units are selected). Each side is `or vector(0)`: a counter has no series until
# its first event, and `a + <nothing>` would be empty.
def refusals_rate(*, window: str = RATE, match: str = UNIT_FILTER, retryable: bool = False) -> str:
    """Requests refused per second, by the units and at the front door; `retryable`: `too_long`
    (a client error, 400) left out."""
    unit = counter_rate(REJECTIONS, window=window, match=match, extra='reason!="too_long"' if retryable else "")
    front = counter_rate(FRONT_REFUSALS, window=window, match="")
    return f"({unit} or vector(0)) + ({front} or vector(0))"


def offered_rate(*, window: str = RATE, match: str = UNIT_FILTER) -> str:
    """Requests offered per second: those that reached a unit plus those the front door refused."""
    front = counter_rate(FRONT_REFUSALS, window=window, match="")
    return f"{counter_rate(ARRIVALS, window=window, match=match)} + ({front} or vector(0))"


def refused_fraction(*, window: str = RATE, match: str = UNIT_FILTER) -> str:
    """Retryable refusals (unit and front door) over requests offered."""
    refused = refusals_rate(window=window, match=match, retryable=True)
    return f"({refused}) / ({offered_rate(window=window, match=match)})"


def refusals_by_where(*, window: str = RATE, match: str = UNIT_FILTER) -> str:
    """Refusals per second by `where` (`unit`, `proxy`, `ingress`) and `reason`: the units' own
    rejections labelled `where="unit"`, beside the front door's."""
    unit = (f'label_replace(rate({selector(REJECTIONS.prom_name, match)}[{window}]), "{WHERE_TAG}", "unit", '
            f'"{UNIT_TAG}", ".*")')
    return (f"{agg('sum', (WHERE_TAG, 'reason'), unit)} or "
            f"{counter_rate(FRONT_REFUSALS, group=(WHERE_TAG, 'reason'), window=window, match='')}")


def gauge(defn: MetricDef, *, op: str = "max", group: tuple[str, ...] = (UNIT_TAG,), match: str = UNIT_FILTER) -> str:
    """`op by (group) (gauge{match})`; Ray adds worker/node labels, so gauges are always aggregated."""
    _need(defn, "gauge")
    return agg(op, group, selector(defn.prom_name, match))


def quantile(defn: MetricDef, q: float, *, window: str = RATE, match: str = UNIT_FILTER,
             group: tuple[str, ...] = ()) -> str:
    """`histogram_quantile(q, sum by (le, group) (rate(bucket[window])))`."""
    _need(defn, "histogram")
    inner = agg("sum", ("le", *group), f"rate({selector(hist_series(defn, 'bucket'), match)}[{window}])")
    return f"histogram_quantile({q}, {inner})"


def hist_mean(defn: MetricDef, *, window: str = RATE, match: str = UNIT_FILTER) -> str:
    _need(defn, "histogram")
    return (f"sum(rate({selector(hist_series(defn, 'sum'), match)}[{window}])) / "
            f"sum(rate({selector(hist_series(defn, 'count'), match)}[{window}]))")


def fraction_within(defn: MetricDef, bound: float, *, window: str, match: str = "") -> str:
    """Fraction of observations <= bound over the window. `bound` must be a bucket boundary:
    anything else would silently measure a different target."""
    _need(defn, "histogram")
    if float(bound) not in {float(b) for b in defn.boundaries}:
        raise ValueError(f"{bound} is not a bucket boundary of {defn.name} ({list(defn.boundaries)}); "
                         f"an SLO target must be one, or the burn rate measures another target")
    within = selector(hist_series(defn, "bucket"), match, f'le="{le_label(bound)}"')
    total = selector(hist_series(defn, "count"), match)
    return f"sum(rate({within}[{window}])) / sum(rate({total}[{window}]))"


_VARS = re.compile(r"\$(?:__rate_interval|__range|__interval|unit|\{unit\}|\{__rate_interval\})")


def substitute_grafana_vars(expr: str, *, rate_interval: str = "1m", unit: str = ".*", time_range: str = "1h") -> str:
    """An expression as Prometheus sees it once Grafana has filled in its variables."""
    values = {"$__rate_interval": rate_interval, "${__rate_interval}": rate_interval, "$__range": time_range,
              "$__interval": "15s", "$unit": unit, "${unit}": unit}
    return _VARS.sub(lambda m: values[m.group(0)], expr)


def metric_names(expr: str) -> set[str]:
    """Series names an expression reads (identifiers followed by `{` or `[`, or bare `ray_*`)."""
    return set(re.findall(r"\b(ray_[a-zA-Z0-9_]+)\b", expr))
