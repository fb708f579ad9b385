"""Validate rendered objects against Kubernetes' OpenAPI schemas, offline.

Kustomize renders (``kubectl kustomize DIR``) and checks no schema; this does, without a
cluster.

Built-in kinds: the strict JSON schemas ``kubernetes-validate`` bundles (no unknown fields
anywhere), for each version in ``KUBERNETES_VERSIONS``: the oldest these manifests claim
(the gateway's ``preStop: sleep`` needs 1.30) and the newest the package knows. The
package's own ``validate()`` reads its 1 MB of definitions again for every object; this
builds one validator per kind and version from the same files, the same way.
``ServiceMonitor`` is a CRD whose schema no bundle has: it is checked against
``SERVICE_MONITOR_SCHEMA`` below, the subset of prometheus-operator's
``monitoring.coreos.com/v1`` CRD that these manifests use, closed to other fields. Any
other kind without a schema is a problem, never a silent pass.

Usage: ``kubectl kustomize deploy/k8s/base | python -m deploy.k8s.validate`` (needs the
``test`` extra; the objects come on stdin or in the YAML files named).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

KUBERNETES_VERSIONS = ("1.30", "1.37")

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
# From prometheus-operator's ServiceMonitor CRD (v1): the fields used here, their types and
# formats as the CRD declares them.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": _STRING_MAP,
                "annotations": _STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA}


def _where(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


@functools.cache
def _definitions(schema_dir: str, version: str) -> Resource[Any]:
    from kubernetes_validate import utils  # here: only validating needs the package

    return Resource.from_contents(utils.schema_contents(f"{schema_dir}/_definitions.json", version))


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.Validator | None:
    """The strict schema of ``kind`` in Kubernetes ``version`` (None: the bundle has none),
    looked up as ``kubernetes_validate.utils.validate`` does."""
    from kubernetes_validate import utils

    full = max((v for v in utils.all_versions() if utils.major_minor(v) == version), default=None)
    if full is None:
        raise ValueError(f"kubernetes-validate bundles no schemas for {version}")
    schema_dir = f"kubernetes-json-schema/v{full}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        return None
    registry = _definitions(schema_dir, version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(objects: list[dict[str, Any]]) -> list[str]:
    """Every schema violation of ``objects``, as ``Kind/name [version] path: message``."""
    problems: list[str] = []
    for obj in objects:
        custom = CUSTOM_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
        if custom is not None:
            for e in jsonschema.Draft202012Validator(custom).iter_errors(obj):
                path = ".".join(str(p) for p in e.absolute_path)
                problems.append(f"{_where(obj)} [CRD subset] {path}: {e.message}")
            continue
        for version in KUBERNETES_VERSIONS:
            validator = _validator(version, str(obj.get("apiVersion")), str(obj.get("kind")))
            if validator is None:
                problems.append(
                    f"{_where(obj)}: no schema for {obj.get('apiVersion')} in {version}"
                )
                continue
            for e in validator.iter_errors(obj):
                path = ".".join(str(p) for p in e.absolute_path)
                problems.append(f"{_where(obj)} [{version}] {path}: {e.message}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s.validate", description=__doc__)
    parser.add_argument(
        "files", nargs="*", default=["-"], help="YAML streams of objects (- or none: stdin)"
    )
    args = parser.parse_args(argv)
    failed = False
    for name in args.files:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
        objects = [doc for doc in yaml.safe_load_all(text) if doc]
        # nothing is what a failing ``kubectl kustomize`` pipes in: never a pass
        problems = validate(objects) if objects else ["no objects"]
        for p in problems:
            print(f"{name}: {p}", file=sys.stderr)
        failed |= bool(problems)
        print(f"{name}: {'INVALID' if problems else f'{len(objects)} objects valid'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
