"""The docs stay true to the tree: every relative link (and its #anchor) resolves, every
``python -m <module>`` they tell a reader to run exists, and nothing points outside the
repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/README.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"python -m ((?:bench|services|engine|kvstore|transfer|deploy)(?:\.\w+)*)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {
        _slug(line.lstrip("#"))
        for line in path.read_text().splitlines()
        if line.startswith("#") and not line.startswith("#!")
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_the_docs_run_exist(doc: Path) -> None:
    text = doc.read_text()
    missing = [m for m in set(MODULE.findall(text)) if importlib.util.find_spec(m) is None]
    assert not missing, f"{doc.relative_to(ROOT)} tells a reader to run {missing}"
    assert "../shared" not in text, "a file outside the repository is not there for a reader"


def test_the_slug_rule_matches_github() -> None:
    assert _slug(" Overload: admission at the gateway") == "overload-admission-at-the-gateway"
    assert _slug("KV store") == "kv-store"
