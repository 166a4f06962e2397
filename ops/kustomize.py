"""A small, strict `kustomize build` for the subset k8s/ uses, so overlays validate offline.

Owns: `build(directory)` -> list of objects, supporting exactly `resources` (files and
directories), `patches` with a `target` and an RFC 6902 operation list (inline or `path`), and
`images` (kustomize's legacy image filter: every `containers`/`initContainers` image at any
depth). Anything else in a kustomization.yaml is an error rather than silently ignored; where
`kubectl kustomize` is installed, tests/ops/test_k8s.py checks both agree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}


class KustomizeError(ValueError):
    pass


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KustomizeError(f"{path}: {part!r} does not exist")
    return node


def apply_op(doc: dict[str, Any], op: dict[str, Any]) -> None:
    kind, path = op.get("op"), op.get("path", "")
    parts = _pointer(path)
    parent, last = _parent(doc, parts, path), parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        else:
            raise KustomizeError(f"unsupported op {kind!r}")
        return
    if kind in ("replace", "remove") and last not in parent:
        raise KustomizeError(f"{path}: cannot {kind} a missing field")
    if kind in ("add", "replace"):
        parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[last]
    else:
        raise KustomizeError(f"unsupported op {kind!r}")


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    checks = {"kind": obj.get("kind"), "name": obj.get("metadata", {}).get("name"), "group": group,
              "version": version}
    return all(checks.get(k) == v for k, v in target.items())


def _split_image(image: str) -> tuple[str, str]:
    """(name, suffix) where suffix is ':tag', '@digest' or ''."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    head, _, tail = image.rpartition(":")
    if head and "/" not in tail:
        return head, ":" + tail
    return image, ""


def _set_images(node: Any, rule: dict[str, Any]) -> None:
    if isinstance(node, list):
        for item in node:
            _set_images(item, rule)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                name, suffix = _split_image(container.get("image", ""))
                if name != rule["name"]:
                    continue
                if "newTag" in rule:
                    suffix = f":{rule['newTag']}"
                if "digest" in rule:
                    suffix = f"@{rule['digest']}"
                container["image"] = rule.get("newName", name) + suffix
        _set_images(value, rule)


def _patch_ops(directory: Path, patch: dict[str, Any]) -> list[dict[str, Any]]:
    if "target" not in patch:
        raise KustomizeError(f"{directory}: only targeted RFC 6902 patches are supported")
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError(f"{directory}: patch {patch.get('path', '<inline>')} is not an RFC 6902 op list")
    return ops


def build(directory: Path) -> list[dict[str, Any]]:
    kfile = directory / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported keys {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for res in spec.get("resources") or []:
        path = directory / res
        objects += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in spec.get("patches") or []:
        ops = _patch_ops(directory, patch)
        hits = [o for o in objects if _matches(o, patch["target"])]
        if not hits:
            raise KustomizeError(f"{kfile}: patch target {patch['target']} matches nothing")
        for obj in hits:
            for op in ops:
                apply_op(obj, op)
    for rule in spec.get("images") or []:
        _set_images(objects, rule)
    return objects
