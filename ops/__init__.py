"""Operations: KubeRay manifests, Grafana dashboards, Prometheus alert rules, their validation and CLI.

Everything here is generated from serve_app/metric_defs.py and the Serve config files; see
docs/operations.md. Rendering never imports ray; validation does (Ray's ServeDeploySchema, through
serve_app.config_check), and only when called.
"""
