"""The environment a tidalserve cluster's processes start with.

Owns: `CLUSTER_ENV`, the variables Serve reads in its proxy and its replicas when they start, so a
Serve config cannot set them: `make serve` sets them in its recipe (tests/test_make_serve_env.py
holds the two together), the test and benchmark clusters set them before Ray starts, and the
KubeRay manifests set them on every Ray container (k8s/base/rayservice.yaml).

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
