"""`tidal k8s render|validate` and `tidal dashboards render|push`.

Owns: argument parsing and printing for the operations commands; the work is in
ops/manifests.py, validate.py, dashboards.py and grafana.py. Ray is only imported
by `k8s validate` (Ray's ServeDeploySchema checks the embedded serve config).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ops.targets import PROD_CONFIG, REPO_ROOT, SIM_CONFIG

K8S_DIR = REPO_ROOT / "k8s"


def register(sub: Any) -> None:
    k8s = sub.add_parser("k8s", help="render and validate the KubeRay manifests under k8s/")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    p = k8s_sub.add_parser("render", help="write the generated manifests (RayService from the Serve config, "
                                          "monitoring, sim-cpu overlay, rule file, dashboards)")
    p.add_argument("--config", type=Path, default=PROD_CONFIG, help="production Serve config (serveConfigV2, "
                                                                       "SLO targets); default configs/prod.yaml")
    p.add_argument("--sim-config", type=Path, default=SIM_CONFIG, help="sim-cpu overlay's Serve config")
    p.add_argument("--out", type=Path, default=K8S_DIR, help="root of the k8s tree (default: the repo's k8s/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    p.set_defaults(func=_k8s_render)
    p = k8s_sub.add_parser("validate", help="validate every kustomization offline (CRD schemas, strict core "
                                            "schemas, serve config, consistency, promtool)")
    p.add_argument("--dir", type=Path, default=K8S_DIR, help="root of the k8s tree (default: the repo's k8s/)")
    p.add_argument("--no-drift", action="store_true", help="skip the check that generated files are current")
    p.set_defaults(func=_k8s_validate)

    dash = sub.add_parser("dashboards", help="render or push the Grafana dashboards")
    dash_sub = dash.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    p = dash_sub.add_parser("render", help="write the dashboard JSON files")
    p.add_argument("--config", type=Path, default=PROD_CONFIG, help="Serve config with the SLO targets")
    p.add_argument("--out", type=Path, default=K8S_DIR / "grafana", help="directory, or - for stdout")
    p.set_defaults(func=_dashboards_render)
    p = dash_sub.add_parser("push", help="upload the dashboards (and a Prometheus datasource) to Grafana")
    p.add_argument("--url", required=True, help="Grafana base URL, e.g. https://grafana.example.com")
    p.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                   help="service-account token (default: $GRAFANA_TOKEN)")
    p.add_argument("--with-datasource", metavar="PROM_URL", help="also create/update a Prometheus datasource")
    p.add_argument("--folder", default="tidalserve", help="dashboard folder ('' for General)")
    p.add_argument("--config", type=Path, default=PROD_CONFIG, help="Serve config with the SLO targets")
    p.set_defaults(func=_dashboards_push)


def _k8s_render(args: argparse.Namespace) -> int:
    from ops import manifests

    tree = manifests.render_tree(args.config, args.sim_config)
    if args.check:
        stale = manifests.stale_files(tree, args.out)
        for rel in stale:
            print(f"stale: {args.out / rel} (run `tidal k8s render`)", file=sys.stderr)
        return 1 if stale else 0
    for path in manifests.write_tree(tree, args.out):
        print(path)
    return 0


def _k8s_validate(args: argparse.Namespace) -> int:
    from ops import manifests, validate

    failed = False
    if not args.no_drift:
        for rel in manifests.stale_files(manifests.render_tree(), args.dir):
            print(f"stale generated file: {rel} (run `tidal k8s render`)")
            failed = True
    for kustomization, errors in validate.validate_tree(args.dir).items():
        print(f"{kustomization}: {'ok' if not errors else f'{len(errors)} error(s)'}")
        for error in errors:
            print(f"  {error}")
        failed |= bool(errors)
    return 1 if failed else 0


def _dashboards(config: Path) -> dict[str, dict[str, Any]]:
    from ops import dashboards
    from ops.targets import load_targets

    return dashboards.all_dashboards(load_targets(config))


def _dashboards_render(args: argparse.Namespace) -> int:
    from ops.manifests import dashboard_json

    dashes = _dashboards(args.config)
    if str(args.out) == "-":
        for dash in dashes.values():
            sys.stdout.write(dashboard_json(dash))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, dash in dashes.items():
        (args.out / name).write_text(dashboard_json(dash))
        print(args.out / name)
    return 0


def _dashboards_push(args: argparse.Namespace) -> int:
    from ops.grafana import push

    if not args.token:
        print("a Grafana token is needed: --token or $GRAFANA_TOKEN", file=sys.stderr)
        return 2
    try:
        actions = push(args.url, args.token, _dashboards(args.config), prometheus_url=args.with_datasource,
                       folder=args.folder or None)
    except Exception as exc:  # the client's errors carry the HTTP status and Grafana's message
        print(f"push failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(actions, indent=2))
    return 0
