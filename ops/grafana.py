"""Upload the tidalserve dashboards (and optionally a Prometheus datasource) to Grafana.

Owns: `push(...)`, the client side of `tidal dashboards push`, through `grafana-client` (the
maintained fork of `grafana-api`, same call shapes, on niquests): folder created if missing,
datasource created or updated by a fixed uid, dashboards saved with `overwrite` (the uid is
stable, so a push replaces the previous version and Grafana keeps the history).
Authentication is a service-account token (Bearer). Must not import ray.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

DATASOURCE_NAME = "tidalserve-prometheus"
DATASOURCE_UID = "tidalserve-prometheus"
FOLDER_TITLE = "tidalserve"
FOLDER_UID = "tidalserve"


def _missing(exc: Exception) -> bool:
    return getattr(exc, "status_code", None) == 404


def _get_or_none(call: Callable[[], Any]) -> Any:
    from grafana_client.client import GrafanaClientError

    try:
        return call()
    except GrafanaClientError as exc:
        if _missing(exc):
            return None
        raise


def datasource_payload(prometheus_url: str) -> dict[str, Any]:
    return {"name": DATASOURCE_NAME, "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
            "url": prometheus_url, "isDefault": False,
            "jsonData": {"httpMethod": "POST", "timeInterval": "15s"}}


def ensure_datasource(api: Any, prometheus_url: str) -> str:
    payload = datasource_payload(prometheus_url)
    if _get_or_none(lambda: api.datasource.get_datasource_by_uid(DATASOURCE_UID)) is None:
        api.datasource.create_datasource(payload)
        return f"created datasource {DATASOURCE_NAME} -> {prometheus_url}"
    api.datasource.update_datasource_by_uid(DATASOURCE_UID, payload)
    return f"updated datasource {DATASOURCE_NAME} -> {prometheus_url}"


def ensure_folder(api: Any, title: str, uid: str) -> str:
    if _get_or_none(lambda: api.folder.get_folder(uid)) is None:
        api.folder.create_folder(title, uid=uid)
        return f"created folder {title}"
    return f"folder {title} exists"


def with_default_datasource(dash: dict[str, Any]) -> dict[str, Any]:
    """The dashboard with its `datasource` variable preset to the pushed datasource."""
    out = copy.deepcopy(dash)
    for var in out["templating"]["list"]:
        if var.get("type") == "datasource":
            var["current"] = {"selected": True, "text": DATASOURCE_NAME, "value": DATASOURCE_UID}
    return out


def push(url: str, token: str, dashboards: dict[str, dict[str, Any]], *, prometheus_url: str | None = None,
         folder: str | None = FOLDER_TITLE, timeout_s: float = 10.0) -> list[str]:
    """Push every dashboard; returns what was done, one line per action."""
    from grafana_client.api import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    actions: list[str] = []
    folder_uid = None
    if folder:
        folder_uid = FOLDER_UID if folder == FOLDER_TITLE else folder.lower().replace(" ", "-")
        actions.append(ensure_folder(api, folder, folder_uid))
    if prometheus_url:
        actions.append(ensure_datasource(api, prometheus_url))
    for name, dash in dashboards.items():
        body = with_default_datasource(dash) if prometheus_url else copy.deepcopy(dash)
        body.pop("id", None)  # Grafana matches on uid; a stale numeric id would be rejected
        payload: dict[str, Any] = {"dashboard": body, "overwrite": True, "message": "tidal dashboards push"}
        if folder_uid:
            payload["folderUid"] = folder_uid
        result = api.dashboard.update_dashboard(payload)
        actions.append(f"saved dashboard {dash['uid']} ({name}): {(result or {}).get('url', 'ok')}")
    return actions
