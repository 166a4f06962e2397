"""The environment a tidalserve cluster's processes start with.

Owns: `CLUSTER_ENV`, the variables Serve reads in its proxy and its replicas when they start, and
`CONTROLLER_OPTIONS`, the Serve config's `controller_options` block that carries them. Serve starts
its controller with that block's `runtime_env.env_vars`, and the proxy and the replicas the
controller starts inherit them (Ray merges a child's `env_vars` over its parent's), so every
shipped config carries the block and `serve run configs/X.yaml` (hence `make serve`) needs no
exports; tests/test_cluster_env.py holds the configs to `CLUSTER_ENV`. The test and benchmark
clusters start Serve with the shipped config's block. The block applies only when the controller
is first created, so the KubeRay manifests also set the variables on every Ray container
(k8s/base/rayservice.yaml).

- The front gate in Serve's proxy (serve_app/proxy_gate.py: its `middlewares` as Serve's proxy
  callback).
- Serve's data plane over gRPC (`RAY_SERVE_USE_GRPC_BY_DEFAULT=1`): the proxy's call to the
  ingress and the ingress's calls to a unit go to the replica's own gRPC server instead of through
  Ray actor tasks and the object store. Every streamed chunk crosses both hops, and on the dev
  server that halved what the proxy, the ingress and the unit spend per token (about 3.5 to 2.2 ms
  of CPU per output token; benchmarks/RESULTS.md, "Serve's data plane over gRPC"). It is the part
  of Ray's `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode this server takes; that mode's direct ingress
  would bypass the proxy and its gate.

Imports nothing: ops/k8s.py writes it into the manifests.
"""

from __future__ import annotations

PROXY_GATE_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.proxy_gate:middlewares"}

GRPC_DATA_PLANE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}

CLUSTER_ENV = {**PROXY_GATE_ENV, **GRPC_DATA_PLANE_ENV}

CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": CLUSTER_ENV}}
"""The `controller_options` every shipped config carries (configs/*.yaml)."""
