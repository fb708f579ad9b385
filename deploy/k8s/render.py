"""Render a kustomization offline: the subset of kustomize that pdserve's manifests use.

There is no kustomize or kubectl binary in CI, yet tests/deploy must check what
`kubectl apply -k` would create. This renders exactly these kustomization keys, with
kustomize's meaning, and refuses every other key (and any case it does not model), so its
output cannot silently differ from kustomize's:

- ``resources``: YAML files (every document in them) and directories holding a
  kustomization (rendered first, recursively); no remote URLs;
- ``namespace``: set on every namespaced object, replacing what it had; an object of a kind
  this module does not know to be namespaced is refused;
- ``images``: ``name`` with ``newName``/``newTag``/``digest``, applied to every
  ``containers``/``initContainers`` entry whose image is ``name`` (any tag or digest);
- ``replicas``: ``name`` and ``count``, setting ``spec.replicas`` of that workload.

Output order is input order (kustomize sorts by kind; ``kubectl apply`` does not care).
Usage: ``python -m deploy.k8s.render deploy/k8s/base > stack.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
API_VERSION = "kustomize.config.k8s.io/v1beta1"
SUPPORTED_KEYS = frozenset({"apiVersion", "kind", "resources", "namespace", "images", "replicas"})
# Kinds whose objects live in a namespace; cluster-scoped kinds (Namespace, ClusterRole...)
# and kinds kustomize treats specially (RoleBinding subjects) are not modelled.
NAMESPACED_KINDS = frozenset({
    "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret",
    "Service", "ServiceAccount", "ServiceMonitor", "StatefulSet",
})  # fmt: skip
SCALABLE_KINDS = frozenset({"Deployment", "ReplicaSet", "ReplicationController", "StatefulSet"})
IMAGE_KEYS = frozenset({"name", "newName", "newTag", "digest"})


class KustomizeError(Exception):
    """The kustomization uses something this renderer does not implement, or is broken."""


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` would print (in input order)."""
    directory = Path(directory)
    found = [directory / n for n in KUSTOMIZATION_NAMES if (directory / n).is_file()]
    if len(found) != 1:
        raise KustomizeError(f"{directory}: want exactly one kustomization file, found {found}")
    spec = yaml.safe_load(found[0].read_text()) or {}
    where = str(found[0])
    if unknown := sorted(set(spec) - SUPPORTED_KEYS):
        raise KustomizeError(f"{where}: render.py does not implement {unknown}")
    if (spec.get("apiVersion"), spec.get("kind")) != (API_VERSION, "Kustomization"):
        raise KustomizeError(f"{where}: not a {API_VERSION} Kustomization")

    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources") or []:
        path = directory / str(entry)
        if path.is_dir():
            objects += render(path)
        elif path.is_file():
            objects += _load_documents(path)
        else:
            raise KustomizeError(f"{where}: resource {entry!r} is not a local file or directory")

    for item in spec.get("replicas") or []:
        _set_replicas(objects, item, where)
    for item in spec.get("images") or []:
        _set_image(objects, item, where)
    if "namespace" in spec:
        _set_namespace(objects, spec["namespace"], where)
    _refuse_duplicates(objects, where)
    return objects


def _load_documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= set(d):
            raise KustomizeError(f"{path}: a document is not a Kubernetes object: {d!r:.80}")
        if not d["metadata"].get("name"):
            raise KustomizeError(f"{path}: a {d['kind']} has no metadata.name")
    return docs


def _set_replicas(objects: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    if set(item) != {"name", "count"} or not isinstance(item["count"], int):
        raise KustomizeError(f"{where}: replicas entries are {{name, count: int}}, got {item}")
    hits = [
        o for o in objects if o["kind"] in SCALABLE_KINDS and o["metadata"]["name"] == item["name"]
    ]
    if not hits:
        raise KustomizeError(f"{where}: replicas: no workload named {item['name']!r}")
    for o in hits:
        o.setdefault("spec", {})["replicas"] = item["count"]


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``registry:5000/name:tag@sha256:...`` -> (``registry:5000/name``, tag, digest)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _set_image(objects: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    if "name" not in item or set(item) - IMAGE_KEYS or len(item) < 2:
        raise KustomizeError(f"{where}: images entries are name plus any of {sorted(IMAGE_KEYS)}")
    if "newTag" in item and "digest" in item:
        raise KustomizeError(f"{where}: images: newTag and digest exclude each other")
    matched = False
    for container in (c for o in objects for c in _containers(o)):
        name, tag, digest = split_image(str(container.get("image", "")))
        if name != item["name"]:
            continue
        matched = True
        name = item.get("newName", name)
        if "digest" in item:
            container["image"] = f"{name}@{item['digest']}"
        elif "newTag" in item:
            container["image"] = f"{name}:{item['newTag']}"
        else:
            container["image"] = (
                name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
            )
    if not matched:
        raise KustomizeError(f"{where}: images: no container runs {item['name']!r}")


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every entry of a ``containers`` or ``initContainers`` list, anywhere in ``node`` (as
    kustomize's image transformer finds them, whatever the kind)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def _set_namespace(objects: list[dict[str, Any]], namespace: Any, where: str) -> None:
    if not isinstance(namespace, str) or not namespace:
        raise KustomizeError(f"{where}: namespace must be a name, got {namespace!r}")
    for o in objects:
        if o["kind"] not in NAMESPACED_KINDS:
            raise KustomizeError(
                f"{where}: render.py does not know whether {o['kind']} is namespaced"
            )
        o["metadata"]["namespace"] = namespace


def _refuse_duplicates(objects: list[dict[str, Any]], where: str) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for o in objects:
        group = o["apiVersion"].rpartition("/")[0]
        key = (group, o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{where}: {key} appears twice")
        seen.add(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s.render", description=__doc__)
    parser.add_argument("directory", help="a directory holding a kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        objects = render(args.directory)
    except KustomizeError as e:
        print(f"render: {e}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(objects, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
