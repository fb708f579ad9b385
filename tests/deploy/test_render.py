"""deploy/k8s/render.py: the objects kustomize itself renders, through an overlay, and
kustomize's refusal as an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.k8s.render import KustomizeError, render

HEAD = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}


def _deployment(name: str, image: str) -> dict[str, Any]:
    pod = {"containers": [{"name": name, "image": image}],
           "initContainers": [{"name": "init", "image": image}]}  # fmt: skip
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"spec": pod}}}  # fmt: skip


def _write(directory: Path, kustomization: dict[str, Any], **files: list[dict[str, Any]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({**HEAD, **kustomization}))
    for name, docs in files.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    return directory


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return _write(
        tmp_path / "base",
        {"namespace": "ns", "resources": ["app.yaml"]},
        app=[_deployment("web", "web:1"), _deployment("db", "registry:5000/db@sha256:ab")],
    )


def test_namespace_images_replicas_through_an_overlay(tmp_path: Path, base: Path) -> None:
    overlay = _write(
        tmp_path / "overlay",
        {
            "resources": ["../base"],
            "images": [
                {"name": "web", "newName": "reg.example/web", "newTag": "2"},
                {"name": "registry:5000/db", "digest": "sha256:cd"},
            ],
            "replicas": [{"name": "web", "count": 3}],
        },
    )
    objects = {o["metadata"]["name"]: o for o in render(overlay)}
    web, db = objects["web"], objects["db"]
    assert web["metadata"]["namespace"] == db["metadata"]["namespace"] == "ns"
    pod = web["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == pod["initContainers"][0]["image"] == "reg.example/web:2"
    assert db["spec"]["template"]["spec"]["containers"][0]["image"] == "registry:5000/db@sha256:cd"
    assert web["spec"]["replicas"] == 3 and "replicas" not in db["spec"]


def test_an_overlay_namespace_replaces_the_base_one(tmp_path: Path, base: Path) -> None:
    overlay = _write(tmp_path / "overlay", {"resources": ["../base"], "namespace": "other"})
    assert {o["metadata"]["namespace"] for o in render(overlay)} == {"other"}


def test_a_broken_kustomization_is_an_error_with_kustomizes_reason(
    tmp_path: Path, base: Path
) -> None:
    with pytest.raises(KustomizeError, match="kustomization"):
        render(tmp_path)  # none there
    (base / "kustomization.yaml").write_text(yaml.safe_dump({**HEAD, "resources": ["gone.yaml"]}))
    with pytest.raises(KustomizeError, match=r"gone\.yaml"):
        render(base)
