"""The KubeRay manifests: rendered from the configs byte for byte, valid against the KubeRay CRD
schemas (strict), Kubernetes core schemas (strict), Ray's ServeDeploySchema and tidalserve's own
strict config check, and consistent with the Serve config they embed."""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from ops import exposure, k8s, kustomize, manifests, validate
from ops.k8s_checks import check_rayservice, quantity
from ops.targets import PROD_CONFIG, REPO_ROOT, SIM_CONFIG
from tidal_cli import main as tidal

K8S = REPO_ROOT / "k8s"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def tree() -> dict[str, str]:
    return manifests.render_tree()


@pytest.fixture(scope="module")
def prod_rs() -> Obj:
    (rs,) = [o for o in kustomize.build(K8S / "overlays" / "prod") if o["kind"] == "RayService"]
    return rs


@pytest.fixture(scope="module")
def sim_rs() -> Obj:
    (rs,) = [o for o in kustomize.build(K8S / "overlays" / "sim-cpu") if o["kind"] == "RayService"]
    return rs


def test_render_reproduces_the_committed_files_byte_for_byte(tree: dict[str, str]) -> None:
    assert set(tree) >= {manifests.RAYSERVICE, manifests.NETWORK_POLICY, manifests.SIM_PATCH, manifests.PODMONITOR,
                         manifests.RULE_FILE}
    for rel, text in tree.items():
        assert (K8S / rel).read_text() == text, f"k8s/{rel} is stale: run `tidal k8s render`"


def test_every_kustomization_validates() -> None:
    report = validate.validate_tree(K8S)
    assert set(report) == set(validate.KUSTOMIZATIONS)
    assert report == {k: [] for k in validate.KUSTOMIZATIONS}


def test_overlays_hold_what_they_should(prod_rs: Obj, sim_rs: Obj) -> None:
    prod_kinds = sorted(o["kind"] for o in kustomize.build(K8S / "overlays" / "prod"))
    assert prod_kinds == ["ConfigMap", "NetworkPolicy", "PodMonitor", "PrometheusRule", "RayService"]
    assert [o["kind"] for o in kustomize.build(K8S / "overlays" / "sim-cpu")] == ["RayService", "NetworkPolicy"]
    assert prod_rs["spec"]["serveConfigV2"] == PROD_CONFIG.read_text()
    assert sim_rs["spec"]["serveConfigV2"] == SIM_CONFIG.read_text()
    for rs in (prod_rs, sim_rs):  # also inside validate_object (check_serve_config starts with it)
        ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    worker = prod_rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["nodeSelector"] and worker["tolerations"]  # the placeholders the user edits
    images = {c["image"] for rs in (prod_rs, sim_rs) for c in _containers(rs)}
    assert images == {"registry.example.com/ml/tidalserve:0.1.0", "tidalserve:dev"}


def _containers(rs: Obj) -> list[Obj]:
    return [c for _, t in validate.pod_templates(rs) for c in t["spec"]["containers"]]


def test_sim_overlay_is_the_direct_render_of_sim_yaml(sim_rs: Obj) -> None:
    direct = k8s.rayservice(SIM_CONFIG.read_text(), k8s.SIM_CPU)
    for container in _containers(direct):
        container["image"] = "tidalserve:dev"
    assert sim_rs == direct


def test_production_shape(prod_rs: Obj) -> None:
    spec = prod_rs["spec"]
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert limits["nvidia.com/gpu"] == "8"
    assert (workers["minReplicas"], workers["replicas"], workers["maxReplicas"]) == (1, 2, 8)
    assert cluster["enableInTreeAutoscaling"] is True
    assert spec["upgradeStrategy"]["type"] in k8s.UPGRADE_TYPES
    assert cluster["authOptions"] == {"mode": "token", "secretName": k8s.AUTH_SECRET}
    for group in (head, workers):
        assert group["rayStartParams"]["metrics-export-port"] == str(k8s.METRICS_PORT)
    env = {e["name"]: e for e in workers["template"]["spec"]["containers"][0]["env"]}
    assert env["TIDAL_MODEL"]["value"] == "/models/Meta-Llama-3-70B-Instruct"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == k8s.AUTH_SECRET
    shm = {v["name"]: v for v in workers["template"]["spec"]["volumes"]}["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert spec["rayClusterDeletionDelaySeconds"] == yaml.safe_load(PROD_CONFIG.read_text())["http_options"][
        "request_timeout_s"]


def test_crd_has_no_enum_for_the_upgrade_type_so_we_check_it() -> None:
    schema = validate.crd_schema("RayService")["properties"]["spec"]["properties"]["upgradeStrategy"]
    assert "enum" not in schema["properties"]["type"], "the CRD now has an enum: use it instead of UPGRADE_TYPES"


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        *parents, last = [p.replace("~1", "/") for p in path.split("/")]  # JSON-pointer escaping
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return mutate


def _serve(old: str, new: str) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        assert old in obj["spec"]["serveConfigV2"]
        obj["spec"]["serveConfigV2"] = obj["spec"]["serveConfigV2"].replace(old, new)
    return mutate


WORKER = "spec/rayClusterConfig/workerGroupSpecs/0"
WORKER_C = f"{WORKER}/template/spec/containers/0"
BAD = {
    "typo in the worker group": (_set(f"{WORKER}/minReplica", 1), "minReplica"),
    "typo in a container": (_set(f"{WORKER_C}/imagePullPolicyy", "Always"), "imagePullPolicyy"),
    "typo in the cluster": (_set("spec/rayClusterConfig/enableInTreeAutoscalng", True), "enableInTreeAutoscalng"),
    "typo in serveConfigV2": (_serve("max_ongoing_requests: 2048", "max_ongoing_request: 2048"),
                              "max_ongoing_request"),
    "inverted serve bounds": (_serve("max_replicas: 8", "max_replicas: 0"), "min_replicas <= initial_replicas"),
    "GPUs per node": (_set(f"{WORKER_C}/resources/limits/nvidia.com~1gpu", "4"), "GPU"),
    "worker bounds": (_set(f"{WORKER}/maxReplicas", 4), "unit bounds"),
    "metrics port": (_set(f"{WORKER}/rayStartParams/metrics-export-port", "9090"), "metrics-export-port"),
    "upgrade type": (_set("spec/upgradeStrategy/type", "Recreate"), "upgradeStrategy.type"),
    "auth off": (_set("spec/rayClusterConfig/authOptions/mode", "disabled"), "authOptions.mode"),
    "auth env off": (_set(f"{WORKER_C}/env/0/value", "disabled"), "RAY_AUTH_MODE"),
    "ray version": (_set("spec/rayClusterConfig/rayVersion", "2.9.0"), "rayVersion"),
    "object store over shm": (_set(f"{WORKER}/rayStartParams/object-store-memory", str(128 * 2**30)), "dev/shm"),
}


def _policy(objects: list[Obj]) -> Obj:
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    return policy


def _rs(objects: list[Obj]) -> Obj:
    (rs,) = [o for o in objects if o["kind"] == "RayService"]
    return rs


def _drop_policy(objects: list[Obj]) -> None:
    objects.remove(_policy(objects))


def _open_dashboard(objects: list[Obj]) -> None:
    _policy(objects)["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 8265}]})


def _open_everything(objects: list[Obj]) -> None:
    _policy(objects)["spec"]["ingress"].append({})


def _unpublish_serve(objects: list[Obj]) -> None:
    _policy(objects)["spec"]["ingress"].pop(0)


def _other_pods(objects: list[Obj]) -> None:
    _policy(objects)["spec"]["podSelector"] = {"matchLabels": {"app": "something-else"}}


def _keys_optional(objects: list[Obj]) -> None:
    _serve("required: true", "required: false")(_rs(objects))


def _sub_path(objects: list[Obj]) -> None:
    worker = _rs(objects)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (mount,) = [m for m in worker["containers"][0]["volumeMounts"] if m["name"] == exposure.API_KEYS_VOLUME]
    mount["subPath"] = "keys"


def _no_head_mount(objects: list[Obj]) -> None:
    head = _rs(objects)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["volumeMounts"] = []


EXPOSURE_BAD = {
    "no policy": (_drop_policy, "no NetworkPolicy"),
    "dashboard open to anyone": (_open_dashboard, "other than Serve's"),
    "every port open": (_open_everything, "['all']"),
    "serve port not published": (_unpublish_serve, "does not publish the Serve port 8000"),
    "policy selects other pods": (_other_pods, "does not select the Ray pods"),
    "keys optional": (_keys_optional, "auth.required"),
    "subPath mount": (_sub_path, "subPath"),
    "no mount on the head": (_no_head_mount, "head: the tidal-api-keys Secret is not mounted"),
}


def test_exposure_is_what_clients_need() -> None:
    objects = kustomize.build(K8S / "overlays" / "prod")
    assert validate.exposure_errors(objects) == []
    policy = _policy(objects)
    rules = policy["spec"]["ingress"]
    assert rules[0] == {"ports": [{"protocol": "TCP", "port": 8000}]}  # only the Serve port is public
    assert all("from" in r for r in rules[1:])
    rs = _rs(objects)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    # KubeRay's operator deploys serveConfigV2 through the dashboard on the head Service: it must listen
    # on the pod address; the policy opens its port to the operator and the Ray pods only.
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert [r["ports"] for r in rules if 8265 in [p["port"] for p in r.get("ports", [])]] == [
        [{"protocol": "TCP", "port": 8265}, {"protocol": "TCP", "port": 52365}]]
    keys_file = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["auth"]["keys_file"]
    for _, template in validate.pod_templates(rs):
        (mount,) = [m for m in template["spec"]["containers"][0]["volumeMounts"]
                    if m["name"] == exposure.API_KEYS_VOLUME]
        assert Path(keys_file).parent == Path(mount["mountPath"]) and "subPath" not in mount
    sim = kustomize.build(K8S / "overlays" / "sim-cpu")
    assert validate.exposure_errors(sim, require_keys=False) == []
    assert any("auth.required" in e for e in validate.exposure_errors(sim, require_keys=True))


@pytest.mark.parametrize("name", sorted(EXPOSURE_BAD))
def test_exposure_checks_catch(name: str) -> None:
    mutate, fragment = EXPOSURE_BAD[name]
    objects = copy.deepcopy(kustomize.build(K8S / "overlays" / "prod"))
    mutate(objects)
    errors = validate.exposure_errors(objects)
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize("name", sorted(BAD))
def test_validation_catches(name: str, prod_rs: Obj) -> None:
    mutate, fragment = BAD[name]
    obj = copy.deepcopy(prod_rs)
    mutate(obj)
    errors = validate.validate_object(obj)
    assert any(fragment in e for e in errors), errors


def test_head_only_proxies_must_not_exclude_the_head(sim_rs: Obj) -> None:
    obj = copy.deepcopy(sim_rs)
    assert check_rayservice(obj) == []
    obj["spec"]["excludeHeadPodFromServeSvc"] = True
    assert any("HeadOnly" in e for e in check_rayservice(obj))


def test_worker_group_follows_the_router(tmp_path: Path) -> None:
    text = (PROD_CONFIG.read_text().replace("min_replicas: 1", "min_replicas: 3")
            .replace("initial_replicas: 2", "initial_replicas: 4").replace("max_replicas: 8", "max_replicas: 12"))
    bundles = "          - {GPU: 1, CPU: 1}\n"
    text = text.replace(bundles * 8, bundles * 4).replace("tp: 8", "tp: 4")
    rs = k8s.rayservice(text, k8s.PROD)
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (3, 4, 12)
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert check_rayservice(rs) == []


def test_quantities() -> None:
    assert quantity("64Gi") == 64 * 2**30 and quantity("500m") == 0.5 and quantity("88") == 88
    with pytest.raises(ValueError):
        quantity("lots")


def test_json_patch_ops_and_images() -> None:
    doc: Obj = {"a": {"b": [1, 2]}, "c": 1}
    for op in ({"op": "add", "path": "/a/b/-", "value": 3}, {"op": "replace", "path": "/c", "value": 2},
               {"op": "remove", "path": "/a/b/0"}, {"op": "add", "path": "/a/x~1y", "value": {}}):
        kustomize.apply_op(doc, op)
    assert doc == {"a": {"b": [2, 3], "x/y": {}}, "c": 2}
    with pytest.raises(kustomize.KustomizeError):
        kustomize.apply_op(doc, {"op": "replace", "path": "/missing", "value": 1})
    assert kustomize._split_image("host:5000/tidalserve:1.0") == ("host:5000/tidalserve", ":1.0")
    assert kustomize._split_image("tidalserve") == ("tidalserve", "")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("rel", validate.KUSTOMIZATIONS)
def test_kubectl_kustomize_agrees(rel: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in kustomize.build(K8S / rel)}
    assert ours == theirs


def test_cli_render_and_check(tmp_path: Path) -> None:
    assert tidal(["k8s", "render", "--check"]) == 0
    assert tidal(["k8s", "render", "--out", str(tmp_path)]) == 0
    assert tidal(["k8s", "render", "--check", "--out", str(tmp_path)]) == 0
    (tmp_path / manifests.RAYSERVICE).write_text("# edited by hand\n")
    assert tidal(["k8s", "render", "--check", "--out", str(tmp_path)]) == 1
