"""Operations: KubeRay manifests, Grafana dashboards, Prometheus alert rules, their validation and CLI.

Everything here is generated from serve_app/metric_defs.py and the Serve config files; see
docs/operations.md. Only validate.py (Ray's ServeDeploySchema) imports ray, and only when called.
"""
