"""Where a server's CPU time goes: CPU seconds per process role, from the OS's own counters.

Owns: `CpuSplit`, which snapshots user+system CPU time of every descendant of one server process
(`serve run` or `vllm serve`) grouped by role (the process title: Ray sets `ray::ProxyActor`,
`ray::ServeReplica:<app>:Ingress`, `ray::TPWorker`...; vLLM its `VLLM::EngineCore`), and
reports the difference over a run divided by the output tokens. On a 2-core box the model step
and the per-token front-end work (proxy, ingress, router, streaming) share the same cores, so
this is the profile that says which one to make cheaper. A process that starts mid-run counts
all its CPU time; one that ends mid-run is lost (servers do not restart processes under load).
"""

from __future__ import annotations

import re
from collections import defaultdict

import psutil

_ROLES = [
    (re.compile(r"ProxyActor"), "serve proxy"),
    (re.compile(r"ServeReplica:[^:]+:Ingress"), "ingress"),
    (re.compile(r"ServeReplica:[^:]+:ServingUnit"), "serving unit (scheduler loop)"),
    (re.compile(r"TPWorker"), "model worker"),
    (re.compile(r"ServeController"), "serve controller"),
    (re.compile(r"EngineCore"), "vllm engine core"),
    (re.compile(r"vllm\.entrypoints|APIServer"), "vllm api server"),
    (re.compile(r"raylet|gcs_server|dashboard|log_monitor|runtime_env", re.IGNORECASE), "ray daemons"),
]


def role(proc: psutil.Process) -> str:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    for pattern, name in _ROLES:
        if pattern.search(title):
            return name
    return "other"


class CpuSplit:
    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._start: dict[int, tuple[str, float]] = {}

    def _sample(self) -> dict[int, tuple[str, float]]:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for proc in procs:
            try:
                times = proc.cpu_times()
                out[proc.pid] = (role(proc), times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def start(self) -> None:
        self._start = self._sample()

    def stop(self, output_tokens: int) -> dict[str, float]:
        """CPU milliseconds per output token, by role (and the total)."""
        end = self._sample()
        used: dict[str, float] = defaultdict(float)
        for pid, (name, cpu) in end.items():
            used[name] += cpu - self._start.get(pid, (name, 0.0))[1]
        per_token = {name: round(1000.0 * s / max(1, output_tokens), 2) for name, s in sorted(used.items())
                     if s > 0.005}
        per_token["total"] = round(sum(per_token.values()), 2)
        return per_token
