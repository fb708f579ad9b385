"""Compile a C++ kernel of ``kernels/csrc`` once per process, or report that it cannot be.

Each kernel is built on first use with the machine's C++ compiler (torch.utils.cpp_extension,
cached under ``TORCH_EXTENSIONS_DIR``). The CPU's instruction set and the source's digest are
part of the module name: a cached build never runs on a CPU without its ISA (an image built
on one machine and run on another), and two checkouts of different sources keep a build
each instead of rebuilding in turn. A kernel that cannot be built (no compiler, no ninja,
no headers) is reported once and its callers keep their torch path.

Builders of one module take turns under an OS lock (``build_lock``), which dies with its
holder: torch's own lock file outlives a builder killed mid-compile, and every later start
would wait on it forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_LOCK_TIMEOUT_S = 900.0  # a cold build of the largest kernel takes minutes on 2 cores


class Extension:
    """One C++ source file, loaded lazily and at most once."""

    def __init__(self, stem: str, extra_cflags: tuple[str, ...] = ()) -> None:
        self.stem = stem
        self.source = CSRC / f"{stem}.cpp"
        self.extra_cflags = extra_cflags
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failed = False

    def load(self) -> ModuleType | None:
        if self._module is not None:  # the hot path: every kernel call asks
            return self._module
        with self._lock:
            if self._module is not None or self._failed:
                return self._module
            try:
                from torch.utils.cpp_extension import _get_build_directory

                isa, flags = isa_flags()
                name = f"pdserve_{self.stem}_{isa}_{source_digest(self.source)}"
                with build_lock(Path(_get_build_directory(name, verbose=False))):
                    self._module = self.compile(name, flags)
            except Exception as e:  # no compiler, no ninja, no headers: keep the reference
                self._failed = True
                log.warning("cpu_kernel_unavailable", kernel=self.stem, error=str(e))
            return self._module

    def compile(
        self, name: str, isa_cflags: list[str], build_directory: Path | None = None
    ) -> ModuleType:
        """Build and load the source as module ``name`` for the ISA flags ``isa_cflags``
        (``load`` passes this CPU's; a test may build another ISA's into its own directory)."""
        from torch.utils.cpp_extension import load

        return load(
            name=name,
            sources=[str(self.source)],
            extra_include_paths=[str(CSRC)],
            # -fopenmp: at::parallel_for runs on torch's intra-op threads (without it the
            # header falls back to one thread). It links libgomp.so.1 by soname: the copy
            # torch loaded, so one OpenMP runtime per process.
            extra_cflags=["-O3", "-fopenmp", *isa_cflags, *self.extra_cflags],
            extra_ldflags=["-fopenmp"],
            build_directory=None if build_directory is None else str(build_directory),
            verbose=False,
        )

    def require(self) -> ModuleType:
        """The loaded module; ``RuntimeError`` when the kernel could not be built."""
        mod = self.load()
        if mod is None:
            raise RuntimeError(f"the CPU kernel {self.stem!r} is not available")
        return mod


def source_digest(source: Path) -> str:
    """The source's digest with every shared header of ``csrc`` (a header change rebuilds)
    and the directory it is built from: torch's build depends on the include path, so two
    checkouts on one machine sharing a name would rebuild each other's module each time."""
    h = hashlib.sha256(str(CSRC).encode())
    h.update(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        h.update(header.read_bytes())
    return h.hexdigest()[:12]


def isa_flags() -> tuple[str, list[str]]:
    """AVX2+FMA+F16C where this CPU has them (the kernels' fast paths), else portable code.

    Where it also has AVX-512F and VL the same code is built with them: 32 vector registers
    instead of 16, which the tiled quantized product uses for passes of up to 6 input rows,
    16 lanes wide (``csrc/quant_linear.cpp``). Everything else is written 8 lanes wide and
    the compiler's own vectorizing stays at 256 bits (``-mprefer-vector-width=256``): code
    written for AVX2 gains nothing from wider vectors it did not ask for, and some CPUs slow
    their clock for 512-bit code."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return isa_for(flags)


def isa_for(flags: set[str]) -> tuple[str, list[str]]:
    """The build's ISA name and compiler flags for a CPU with these ``/proc/cpuinfo`` flags."""
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic", []
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    if {"avx512f", "avx512vl"} <= flags:
        return "avx512", [*avx2, "-mavx512f", "-mavx512vl", "-mprefer-vector-width=256"]
    return "avx2", avx2


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float = BUILD_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold ``build_dir``'s lock (``flock``: released when its holder dies, however it dies).

    Every builder of the module holds it around torch's ``load``, so a torch lock file found
    while holding it was left by a builder killed mid-compile, and is removed. Raises
    ``TimeoutError`` when another process holds it for ``timeout_s``.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pdserve.lock", "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been building {build_dir} for {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
