"""deploy/k8s/render.py: kustomize's meaning for the keys it implements, a refusal for
everything else."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.k8s.render import KustomizeError, main, render, split_image

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
    web, db = render(overlay)
    assert web["metadata"]["namespace"] == db["metadata"]["namespace"] == "ns"
    pod = web["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == pod["initContainers"][0]["image"] == "reg.example/web:2"
    assert db["spec"]["template"]["spec"]["containers"][0]["image"] == "registry:5000/db@sha256:cd"
    assert web["spec"]["replicas"] == 3 and "replicas" not in db["spec"]


def test_an_overlay_namespace_replaces_the_base_one(tmp_path: Path, base: Path) -> None:
    overlay = _write(tmp_path / "overlay", {"resources": ["../base"], "namespace": "other"})
    assert {o["metadata"]["namespace"] for o in render(overlay)} == {"other"}


def test_split_image() -> None:
    assert split_image("redis:7") == ("redis", "7", None)
    assert split_image("registry:5000/a/b") == ("registry:5000/a/b", None, None)
    assert split_image("r:5000/b:1@sha256:x") == ("r:5000/b", "1", "sha256:x")


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "an unimplemented key": ({"commonLabels": {"a": "b"}}, "does not implement ['commonLabels']"),
    "patches": ({"patches": [{"path": "p.yaml"}]}, "does not implement ['patches']"),
    "a remote resource": (
        {"resources": ["https://github.com/x/y//base"]}, "not a local file or directory"),
    "a cluster-scoped kind": ({"resources": ["ns.yaml"]}, "whether Namespace is namespaced"),
    "replicas of nothing": ({"replicas": [{"name": "nope", "count": 1}]}, "no workload named"),
    "replicas without a count": ({"replicas": [{"name": "web"}]}, "replicas entries"),
    "an image nobody runs": ({"images": [{"name": "nope", "newTag": "1"}]}, "no container runs"),
    "an image entry with unknown keys": (
        {"images": [{"name": "web", "tag": "1"}]}, "images entries"),
    "tag and digest": (
        {"images": [{"name": "web", "newTag": "1", "digest": "sha256:x"}]}, "exclude each other"),
    "a duplicate object": ({"resources": ["app.yaml", "again.yaml"]}, "appears twice"),
    "another kind of file": ({"kind": "Component"}, "not a kustomize.config.k8s.io/v1beta1"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_does_not_implement(tmp_path: Path, name: str) -> None:
    extra, expected = REFUSED[name]
    spec = {"namespace": "ns", "resources": ["app.yaml"], **extra}
    directory = _write(
        tmp_path / "k",
        spec,
        app=[_deployment("web", "web:1")],
        again=[_deployment("web", "web:2")],
        ns=[{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}],
    )
    with pytest.raises(KustomizeError, match=re.escape(expected)):
        render(directory)


def test_refuses_a_directory_without_one_kustomization(tmp_path: Path, base: Path) -> None:
    with pytest.raises(KustomizeError, match="exactly one kustomization"):
        render(tmp_path)
    (base / "kustomization.yml").write_text("")
    with pytest.raises(KustomizeError, match="exactly one kustomization"):
        render(base)


def test_cli_prints_the_objects(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(base)]) == 0
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert names == ["web", "db"]
    assert main([str(base.parent)]) == 1
