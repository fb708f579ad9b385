"""llama.cpp's C++ ``llama-server`` as a benchmark peer: build it (and llama.cpp's bench
tools) from source, start it, stop it.

Benchmark-only: nothing in pdserve, its tests or CI needs the binary. It is the fair peer
(parallel slots, continuous batching); llama-cpp-python's own Python server runs one request
at a time.

Build (``build``): ``pip download`` the sdist of ``llama-cpp-python`` (pinned), unpack it,
configure ``vendor/llama.cpp`` with cmake for the CPU only (Release, no CUDA/Metal/Vulkan,
no curl, native CPU flags, static libraries) and build the targets in ``BUILD_TARGETS``
(``llama-server``, and the ``llama-bench`` and ``llama-batched-bench`` tools that
``bench.peers.llama_bench`` runs) with one ``cmake --build`` into
``~/.cache/pdserve/llama.cpp/<version>/``. Each step is skipped when its output exists, so
``build`` is idempotent and resumes an interrupted build (or one that predates a target).

Serve (``start``): ``--parallel N`` slots share ``--ctx-size`` equally, so the context is
``N x`` a per-slot size that holds the longest prompt plus its output (``ctx_size_for``).
Continuous batching is llama-server's default; ``--cont-batching`` is passed anyway so the
command states it. Prompt caching stays on (llama-server's default, like pdserve's prefix
cache): a new request goes to the idle slot whose last prompt shares the longest prefix and
reuses that KV, and a host-RAM prompt cache (``--cache-ram``, 8 GiB by default) keeps more.
Benchmarks defeat both with a fresh nonce at the start of each prompt (``--no-cache-prompt``
in ``extra_args`` turns it off instead).

Behaviour of the pinned build, checked on the default model (see ``docs/benchmarks.md``):
a streamed ``/v1/completions`` sends one SSE event per generated token, except that a token
ending inside a multi-byte UTF-8 character sends none (its bytes ride in the next event);
then a final event with ``text: ""``, ``finish_reason`` and ``usage`` (always, with or
without ``stream_options``), then ``data: [DONE]``. ``ignore_eos`` works (end-of-generation
tokens get a -inf logit bias). A prompt given as token ids is used as is (no BOS added).

CLI::

    python -m bench.peers.llama_server build
    python -m bench.peers.llama_server serve --port 8080 --parallel 9 --threads 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The ``llama-cpp-python`` sdist the server is built from (its ``vendor/llama.cpp``)."""

BUILD_TARGETS: tuple[str, ...] = ("llama-server", "llama-bench", "llama-batched-bench")
"""The cmake targets ``build`` makes; each binary lands in ``build/bin/<target>``."""

BUILD_JOBS = 2
SLOT_ALIGN = 512
HEALTH_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0

# CPU only and self-contained: static libraries so the binary needs no rpath into the build
# tree; curl off (it would only download models, which we never do). Native CPU flags but
# no AMX: on an AMX host (Intel Xeon, 2026-12-05) ggml's AMX matmul of this build crashed
# every tool on the default model (SIGSEGV in ggml_backend_amx_mul_mat, first prompt), while
# torch's AMX GEMMs ran on the same VM; without AMX llama.cpp runs its AVX-512 code, and an
# explicit -mno-* outranks -march=native. On a CPU without AMX the flags change nothing.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_OPTIONS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_HIP=OFF",
    "-DGGML_SYCL=OFF",
    "-DGGML_OPENCL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


# ---- pure parts ---------------------------------------------------------------------------


def default_cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``~/.cache/pdserve/llama.cpp/<version>/``: where the sources, build and binary live."""
    return Path.home() / ".cache" / "pdserve" / "llama.cpp" / version


@dataclass(frozen=True)
class BuildLayout:
    """Paths inside one version's cache directory."""

    cache_dir: Path
    version: str = LLAMA_CPP_PYTHON_VERSION

    @property
    def sdist_dir(self) -> Path:
        return self.cache_dir / "sdist"

    @property
    def source_root(self) -> Path:
        return self.cache_dir / "src"

    @property
    def llama_cpp_dir(self) -> Path:
        """The llama.cpp tree vendored by the sdist."""
        return self.source_root / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.cache_dir / "build"

    def target_binary(self, target: str) -> Path:
        """Where cmake puts the binary of ``target`` (one of ``BUILD_TARGETS``)."""
        return self.build_dir / "bin" / target

    @property
    def binary(self) -> Path:
        """``llama-server``."""
        return self.target_binary("llama-server")

    @property
    def bench_binary(self) -> Path:
        """``llama-bench``: prompt processing and generation speed of one sequence."""
        return self.target_binary("llama-bench")

    @property
    def batched_bench_binary(self) -> Path:
        """``llama-batched-bench``: speed with several sequences decoded in one batch."""
        return self.target_binary("llama-batched-bench")

    def missing(self) -> list[Path]:
        """The binaries of ``BUILD_TARGETS`` that are not built (not an executable file)."""
        paths = [self.target_binary(t) for t in BUILD_TARGETS]
        return [p for p in paths if not (p.is_file() and os.access(p, os.X_OK))]


def pip_download_command(version: str, dest: Path, python: str = sys.executable) -> list[str]:
    """``pip download`` of the ``llama-cpp-python`` sdist alone (no wheels, no dependencies)."""
    return [
        python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
        f"llama-cpp-python=={version}", "-d", str(dest),
    ]  # fmt: skip


def cmake_configure_command(source: Path, build_dir: Path) -> list[str]:
    """Configure llama.cpp for a CPU-only Release build of its tools (see ``CMAKE_OPTIONS``)."""
    return ["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS]


def cmake_build_command(
    build_dir: Path, jobs: int = BUILD_JOBS, targets: Sequence[str] = BUILD_TARGETS
) -> list[str]:
    """Build ``targets`` (default ``BUILD_TARGETS``) in one ``cmake --build``."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not targets:
        raise ValueError("need at least one target")
    return [
        "cmake", "--build", str(build_dir), "--config", "Release",
        "--target", *targets, "-j", str(jobs),
    ]  # fmt: skip


def slot_ctx_size(prompt_tokens: int, output_tokens: int, align: int = SLOT_ALIGN) -> int:
    """Tokens one slot needs for a prompt plus its output, rounded up to ``align``.

    The rounding leaves headroom for a few extra prompt tokens (a nonce, a BOS token).
    """
    if prompt_tokens < 1 or output_tokens < 0 or align < 1:
        raise ValueError(
            f"need prompt_tokens >= 1, output_tokens >= 0, align >= 1; "
            f"got {prompt_tokens}, {output_tokens}, {align}"
        )
    need = prompt_tokens + output_tokens
    return -(-need // align) * align


def ctx_size_for(
    parallel: int, prompt_tokens: int = 1024, output_tokens: int = 256, align: int = SLOT_ALIGN
) -> int:
    """``--ctx-size`` for ``parallel`` slots: llama-server divides it equally among them, so
    every slot gets ``slot_ctx_size(prompt_tokens, output_tokens, align)`` tokens
    (9 slots, 1,024 + 256 tokens -> 9 x 1,536 = 13,824)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    return parallel * slot_ctx_size(prompt_tokens, output_tokens, align)


@dataclass(frozen=True)
class ServerConfig:
    """One llama-server process: model, address, slots, context and threads."""

    model_path: Path
    port: int
    host: str = "127.0.0.1"
    parallel: int = 9
    ctx_size: int = field(default_factory=lambda: ctx_size_for(9))
    threads: int = 2
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.parallel < 1 or self.threads < 1 or not 0 < self.port < 65536:
            raise ValueError(f"bad server config: {self}")
        if self.ctx_size < self.parallel:
            raise ValueError(f"ctx_size {self.ctx_size} leaves a slot no room: {self}")


def server_command(binary: Path, config: ServerConfig) -> list[str]:
    """The llama-server command line for ``config``.

    ``--threads-batch`` matches ``--threads`` so prompt processing uses the same cores as
    generation; ``--cont-batching`` is the default, stated explicitly. ``--no-kv-unified``
    (the default when ``--parallel`` is given, stated explicitly) keeps one KV stream per
    slot, each ``ctx_size / parallel`` tokens, so a decode step attends only over its own
    sequence's cells. The web UI is off.
    """
    return [
        str(binary),
        "--model", str(config.model_path),
        "--host", config.host,
        "--port", str(config.port),
        "--parallel", str(config.parallel),
        "--ctx-size", str(config.ctx_size),
        "--threads", str(config.threads),
        "--threads-batch", str(config.threads),
        "--cont-batching",
        "--no-kv-unified",
        "--no-webui",
        *config.extra_args,
    ]  # fmt: skip


def parse_cpus(text: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}`` (taskset's list syntax)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            first, last = int(lo), int(hi)
            if first > last:
                raise ValueError(f"bad cpu range {part!r}")
            cpus.update(range(first, last + 1))
        else:
            cpus.add(int(lo))
    if not cpus or min(cpus) < 0:
        raise ValueError(f"bad cpu list {text!r}")
    return cpus


def local_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (a wildcard bind address becomes loopback)."""
    reach = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if ":" in reach:
        reach = "[::1]" if reach == "::" else f"[{reach}]"
    return f"http://{reach}:{port}"


# ---- build --------------------------------------------------------------------------------


def _run(cmd: Sequence[str], say: Callable[[str], None]) -> None:
    say("$ " + " ".join(cmd))
    subprocess.run(list(cmd), check=True)


def _say(message: str) -> None:
    print(f"[llama-server build] {message}", flush=True)


def build(
    version: str = LLAMA_CPP_PYTHON_VERSION,
    cache_dir: Path | None = None,
    *,
    jobs: int = BUILD_JOBS,
    say: Callable[[str], None] = _say,
) -> Path:
    """Build ``BUILD_TARGETS`` from the ``llama-cpp-python==version`` sdist; return the path
    of ``llama-server`` (the others are ``BuildLayout``'s ``bench_binary`` and
    ``batched_bench_binary``).

    Idempotent: returns at once when every binary exists; otherwise each step whose output
    exists (sdist, unpacked sources) is skipped, and cmake resumes a partial build. Needs
    network access to PyPI (first run only), ``cmake`` and a C++ compiler. Raises
    ``subprocess.CalledProcessError`` when a step fails and ``RuntimeError`` when a tool or
    file is missing.
    """
    layout = BuildLayout(cache_dir or default_cache_dir(version), version)
    if not layout.missing():
        say(f"already built: {', '.join(BUILD_TARGETS)} in {layout.binary.parent}")
        return layout.binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"{tool} not found: install it (Debian: apt-get install -y cmake build-essential)"
            )
    started = time.monotonic()
    layout.cache_dir.mkdir(parents=True, exist_ok=True)

    sdist = layout.sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if sdist.is_file():
        say(f"sdist present: {sdist}")
    else:
        say(f"downloading llama-cpp-python=={version} (sdist)")
        _run(pip_download_command(version, layout.sdist_dir), say)
        if not sdist.is_file():
            found = sorted(p.name for p in layout.sdist_dir.iterdir())
            raise RuntimeError(f"pip download did not produce {sdist.name}; found {found}")

    if layout.llama_cpp_dir.is_dir():
        say(f"sources present: {layout.llama_cpp_dir}")
    else:
        say(f"unpacking {sdist.name}")
        staging = layout.cache_dir / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(staging, filter="data")
        shutil.rmtree(layout.source_root, ignore_errors=True)
        staging.rename(layout.source_root)
        if not layout.llama_cpp_dir.is_dir():
            raise RuntimeError(f"{layout.llama_cpp_dir} not in the sdist")

    say("configuring (cmake, CPU only, Release)")
    _run(cmake_configure_command(layout.llama_cpp_dir, layout.build_dir), say)
    say(f"building {', '.join(BUILD_TARGETS)} with -j {jobs} (several minutes on 2 cores)")
    _run(cmake_build_command(layout.build_dir, jobs), say)
    missing = layout.missing()
    if missing:
        raise RuntimeError(f"build finished but {', '.join(map(str, missing))} missing")
    say(f"built {layout.binary.parent} in {time.monotonic() - started:.0f} s")
    return layout.binary


# ---- serve --------------------------------------------------------------------------------


def health_status(base_url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of ``GET /health`` (200 ready, 503 loading), ``None`` when unreachable."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LlamaServer:
    """A running llama-server process; ``stop()`` (or leaving a ``with``) ends it."""

    process: subprocess.Popen[bytes]
    config: ServerConfig
    command: list[str]
    log_path: Path

    @property
    def base_url(self) -> str:
        return local_url(self.config.host, self.config.port)

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Block until ``/health`` answers 200; raise ``RuntimeError`` (with the log's tail)
        if the process exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.process.returncode}) before it was healthy; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if health_status(self.base_url) == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama-server not healthy after {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.2)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return int(self.process.returncode)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start(
    model_path: Path | str,
    *,
    port: int,
    host: str = "127.0.0.1",
    parallel: int = 9,
    ctx_size: int | None = None,
    threads: int = 2,
    cpus: set[int] | None = None,
    log_path: Path | str,
    binary: Path | None = None,
    extra_args: Sequence[str] = (),
    health_timeout_s: float = HEALTH_TIMEOUT_S,
) -> LlamaServer:
    """Start llama-server on ``model_path`` and return once ``/health`` answers 200.

    ``ctx_size`` defaults to ``ctx_size_for(parallel)`` (every slot holds 1,024 + 256 tokens).
    ``cpus`` pins the process (and so all its threads) with ``sched_setaffinity``.
    stdout and stderr go to ``log_path``. ``binary`` defaults to the cached build; raises
    ``FileNotFoundError`` if it is missing (run ``build`` first) and ``RuntimeError`` if the
    server dies or is not healthy within ``health_timeout_s`` (the process is then stopped).
    """
    exe = binary or BuildLayout(default_cache_dir()).binary
    if not exe.is_file():
        raise FileNotFoundError(
            f"{exe} not found: run `python -m bench.peers.llama_server build` first"
        )
    config = ServerConfig(
        model_path=Path(model_path),
        port=port,
        host=host,
        parallel=parallel,
        ctx_size=ctx_size if ctx_size is not None else ctx_size_for(parallel),
        threads=threads,
        extra_args=tuple(extra_args),
    )
    command = server_command(exe, config)
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=pin,
        )  # fmt: skip
    server = LlamaServer(process=process, config=config, command=command, log_path=log)
    try:
        server.wait_healthy(health_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


# ---- CLI ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.llama_server",
        description="Build and run llama.cpp's llama-server as a benchmark peer.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="download, configure and build llama-server and the bench tools (idempotent)"
    )
    b.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist")
    b.add_argument("--cache-dir", type=Path, default=None, help="default: ~/.cache/pdserve/...")
    b.add_argument("--jobs", type=int, default=BUILD_JOBS)

    s = sub.add_parser("serve", help="run llama-server until Ctrl-C")
    s.add_argument("--model", type=Path, default=None, help="default: the SmolLM2 GGUF")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--parallel", type=int, default=9, help="slots (concurrent sequences)")
    s.add_argument("--ctx-size", type=int, default=None, help="default: parallel x slot size")
    s.add_argument("--prompt-tokens", type=int, default=1024, help="longest prompt per slot")
    s.add_argument("--output-tokens", type=int, default=256, help="most output per slot")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--cpus", type=parse_cpus, default=None, help='pin, e.g. "0,1" or "0-1"')
    s.add_argument("--binary", type=Path, default=None, help="default: the cached build")
    s.add_argument("--log-path", type=Path, default=Path("llama-server.log"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "build":
        print(build(args.version, args.cache_dir, jobs=args.jobs))
        return 0
    model = args.model
    if model is None:
        from engine.checkpoint import default_model_path

        model = default_model_path()
    size = args.ctx_size or ctx_size_for(args.parallel, args.prompt_tokens, args.output_tokens)
    server = start(
        model, port=args.port, host=args.host, parallel=args.parallel, ctx_size=size,
        threads=args.threads, cpus=args.cpus, log_path=args.log_path, binary=args.binary,
    )  # fmt: skip
    print(f"READY llama-server {server.base_url} (log {server.log_path})", flush=True)
    print(" ".join(server.command), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while server.process.poll() is None:
            time.sleep(0.5)
        print(f"llama-server exited ({server.process.returncode}); log {server.log_path}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
