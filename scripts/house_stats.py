"""Counts a reader of this tree meets: lines per package, long functions, where engine
defaults are declared, imports between kernels/ and engine/, and the size of the docs.

    python scripts/house_stats.py [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("services", "engine", "kernels", "transfer", "kvstore", "pdserve")
OTHER = ("bench", "deploy", "compose", "scripts", "tests")
LONG = 80
# A figure: a number followed by a unit a measurement carries.
FIGURE = re.compile(
    r"\b\d[\d,.]*\s?(?:ms|µs|us|s|x|×|%|MB|MiB|GB|GiB|KB|KiB|tok/s|tokens/s|GB/s|MB/s)(?![\w])"
)


def _files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "_pb2" not in p.name)


def lines_per_package() -> dict[str, int]:
    return {
        pkg: sum(len(p.read_text().splitlines()) for p in _files(pkg))
        for pkg in PRODUCT + OTHER
        if (ROOT / pkg).is_dir()
    }


def long_functions() -> list[tuple[str, int]]:
    found = []
    for pkg in (*PRODUCT, "bench"):
        for path in _files(pkg):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > LONG:
                        found.append((f"{path.relative_to(ROOT)}:{node.name}", n))
    return sorted(found, key=lambda f: -f[1])


def imports_between(src: str, dst: str) -> list[str]:
    found = []
    for path in _files(src):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == dst or name.startswith(dst + "."):
                    found.append(f"{path.relative_to(ROOT)} -> {name}")
    return found


def engine_default_places() -> list[str]:
    """Product classes that declare a default for a field ``EngineConfig`` has."""
    config_fields = set()
    classes: list[tuple[str, ast.ClassDef]] = []
    for pkg in PRODUCT:
        for path in _files(pkg):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    classes.append((str(path.relative_to(ROOT)), node))
                    if node.name == "EngineConfig":
                        config_fields |= set(_defaults(node))
    return sorted(
        f"{where}:{cls.name} ({len(set(_defaults(cls)) & config_fields)} fields)"
        for where, cls in classes
        if len(set(_defaults(cls)) & config_fields) >= 3
    )


def _defaults(cls: ast.ClassDef) -> list[str]:
    return [
        s.target.id
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and s.value is not None and isinstance(s.target, ast.Name)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    longest = long_functions()
    readme = (ROOT / "README.md").read_text()
    stats = {
        "lines": lines_per_package(),
        "functions_over_80_lines": len(longest),
        "longest_functions": longest[:5],
        "engine_default_places": engine_default_places(),
        "kernels_imports_engine": imports_between("kernels", "engine"),
        "engine_imports_kernels": imports_between("engine", "kernels"),
        "benchmarks_md_lines": len((ROOT / "docs/benchmarks.md").read_text().splitlines()),
        "readme_figures": len(FIGURE.findall(readme)),
    }
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = f"{len(value)}" + "".join(f"\n    {v}" for v in value)
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
