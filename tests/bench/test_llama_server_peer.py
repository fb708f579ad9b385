"""The llama-server peer's pure parts: context sizing, command lines, paths, CPU lists,
and the build's skip logic (with the download and cmake steps recorded, not run).

Nothing here builds or runs llama-server: the binary is a benchmark-only dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from bench.peers import llama_server
from bench.peers.llama_server import (
    BUILD_TARGETS,
    LLAMA_CPP_PYTHON_VERSION,
    BuildLayout,
    ServerConfig,
    cmake_build_command,
    cmake_configure_command,
    ctx_size_for,
    default_cache_dir,
    local_url,
    parse_args,
    parse_cpus,
    pip_download_command,
    server_command,
    slot_ctx_size,
)


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize(
    ("prompt", "output", "align", "expected"),
    [
        (1024, 256, 512, 1536),  # 1,280 rounds up to the next multiple of 512
        (1024, 0, 512, 1024),  # already a multiple: no extra block
        (1, 0, 512, 512),
        (1000, 24, 1, 1024),  # align 1: exactly the need
        (511, 2, 256, 768),
    ],
)
def test_slot_ctx_size_rounds_need_up_to_alignment(
    prompt: int, output: int, align: int, expected: int
) -> None:
    size = slot_ctx_size(prompt, output, align)
    assert size == expected
    assert size >= prompt + output and size % align == 0 and size - (prompt + output) < align


def test_ctx_size_gives_every_slot_a_full_prompt_and_output() -> None:
    assert ctx_size_for(9) == 9 * 1536 == 13824
    for parallel in (1, 2, 5, 9, 32):
        total = ctx_size_for(parallel, 1024, 256)
        # llama-server splits --ctx-size equally among --parallel slots
        assert total % parallel == 0 and total // parallel >= 1024 + 256


@pytest.mark.parametrize("args", [(0, 1024, 256), (4, 0, 256), (4, 1024, -1), (4, 1024, 256, 0)])
def test_ctx_size_rejects_nonsense(args: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        ctx_size_for(*args)


def test_server_command_states_every_sizing_flag() -> None:
    config = ServerConfig(
        model_path=Path("/m/model.gguf"), port=8123, host="127.0.0.1", parallel=4,
        ctx_size=ctx_size_for(4), threads=1, extra_args=("--metrics",),
    )  # fmt: skip
    cmd = server_command(Path("/opt/llama-server"), config)
    assert cmd[0] == "/opt/llama-server"
    assert flag_value(cmd, "--model") == "/m/model.gguf"
    assert flag_value(cmd, "--host") == "127.0.0.1"
    assert flag_value(cmd, "--port") == "8123"
    assert flag_value(cmd, "--parallel") == "4"
    assert flag_value(cmd, "--ctx-size") == str(4 * 1536)
    assert flag_value(cmd, "--threads") == "1"
    assert flag_value(cmd, "--threads-batch") == "1"
    for flag in ("--cont-batching", "--no-kv-unified", "--no-webui"):
        assert cmd.count(flag) == 1
    assert cmd[-1] == "--metrics"


def test_server_config_default_ctx_matches_default_parallel() -> None:
    config = ServerConfig(model_path=Path("m.gguf"), port=8080)
    assert config.parallel == 9 and config.ctx_size == ctx_size_for(9)


@pytest.mark.parametrize(
    "kwargs",
    [{"parallel": 0}, {"threads": 0}, {"port": 0}, {"port": 70000}, {"parallel": 8, "ctx_size": 4}],
)
def test_server_config_rejects_nonsense(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(model_path=Path("m.gguf"), **{"port": 8080, **kwargs})


def test_build_commands_are_cpu_only_release_and_build_every_target_at_once() -> None:
    layout = BuildLayout(Path("/cache/v"), "0.3.36")
    configure = cmake_configure_command(layout.llama_cpp_dir, layout.build_dir)
    assert configure[:5] == ["cmake", "-S", str(layout.llama_cpp_dir), "-B", "/cache/v/build"]
    for option in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF"):
        assert option in configure
    # native flags, but not ggml's AMX matmul (it crashed on an AMX VM): C and C++ alike
    assert "-DGGML_NATIVE=ON" in configure
    for lang in ("C", "CXX"):
        [option] = [o for o in configure if o.startswith(f"-DCMAKE_{lang}_FLAGS=")]
        flags = option.split("=", 1)[1].split()
        assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(flags)
    build = cmake_build_command(layout.build_dir, jobs=2)
    assert build.count("--target") == 1 and build.count("--build") == 1
    at = build.index("--target") + 1
    assert tuple(build[at : at + 3]) == BUILD_TARGETS
    assert set(BUILD_TARGETS) == {"llama-server", "llama-bench", "llama-batched-bench"}
    assert flag_value(build, "-j") == "2"
    only = cmake_build_command(layout.build_dir, targets=("llama-bench",))
    assert only[only.index("--target") + 1 : only.index("-j")] == ["llama-bench"]
    with pytest.raises(ValueError):
        cmake_build_command(layout.build_dir, jobs=0)
    with pytest.raises(ValueError):
        cmake_build_command(layout.build_dir, targets=())


def test_pip_download_fetches_only_the_pinned_sdist() -> None:
    cmd = pip_download_command("0.3.36", Path("/d"), python="py")
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    assert flag_value(cmd, "--no-binary") == ":all:" and "--no-deps" in cmd
    assert "llama-cpp-python==0.3.36" in cmd and flag_value(cmd, "-d") == "/d"


def test_layout_paths_sit_under_the_versioned_cache_dir() -> None:
    cache = default_cache_dir("1.2.3")
    assert cache == Path.home() / ".cache" / "pdserve" / "llama.cpp" / "1.2.3"
    layout = BuildLayout(cache, "1.2.3")
    assert layout.binary == cache / "build" / "bin" / "llama-server"
    assert layout.bench_binary == cache / "build" / "bin" / "llama-bench"
    assert layout.batched_bench_binary == cache / "build" / "bin" / "llama-batched-bench"
    assert layout.llama_cpp_dir == cache / "src" / "llama_cpp_python-1.2.3" / "vendor" / "llama.cpp"
    assert BuildLayout(cache).version == LLAMA_CPP_PYTHON_VERSION


def test_parse_cpus_reads_taskset_lists() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,1") == {0, 1}
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "2-1", "-1", "x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_local_url_maps_wildcard_binds_to_loopback() -> None:
    assert local_url("127.0.0.1", 8080) == "http://127.0.0.1:8080"
    assert local_url("0.0.0.0", 9) == "http://127.0.0.1:9"
    assert local_url("::", 9) == "http://[::1]:9"
    assert local_url("::1", 9) == "http://[::1]:9"


def test_cli_parses_build_and_serve() -> None:
    build = parse_args(["build"])
    assert build.cmd == "build" and build.version == LLAMA_CPP_PYTHON_VERSION
    assert build.jobs == 2
    serve = parse_args(["serve", "--port", "8080", "--parallel", "9", "--threads", "2"])
    assert (serve.cmd, serve.port, serve.parallel, serve.threads) == ("serve", 8080, 9, 2)
    assert serve.ctx_size is None and serve.cpus is None
    assert parse_args(["serve", "--cpus", "0-1"]).cpus == {0, 1}


def _executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def _recording_run(
    layout: BuildLayout, calls: list[list[str]]
) -> Callable[[Sequence[str], Callable[[str], None]], None]:
    """Stands in for ``_run``: records the command; cmake --build makes the binaries."""

    def run(cmd: Sequence[str], say: Callable[[str], None]) -> None:
        calls.append(list(cmd))
        if cmd[:2] == ["cmake", "--build"]:
            for target in cmd[cmd.index("--target") + 1 : cmd.index("-j")]:
                _executable(layout.target_binary(target))

    return run


def test_missing_lists_binaries_that_are_not_executable(tmp_path: Path) -> None:
    layout = BuildLayout(tmp_path)
    assert layout.missing() == [layout.target_binary(t) for t in BUILD_TARGETS]
    _executable(layout.binary)
    layout.bench_binary.write_text("not executable")
    assert layout.missing() == [layout.bench_binary, layout.batched_bench_binary]
    for target in BUILD_TARGETS:
        _executable(layout.target_binary(target))
    assert layout.missing() == []


def test_build_is_a_no_op_once_every_binary_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = BuildLayout(tmp_path, "9.9.9")
    for target in BUILD_TARGETS:
        _executable(layout.target_binary(target))
    calls: list[list[str]] = []
    monkeypatch.setattr(llama_server, "_run", _recording_run(layout, calls))
    assert llama_server.build("9.9.9", tmp_path, say=lambda _: None) == layout.binary
    assert calls == []


def test_build_adds_the_bench_tools_to_a_server_only_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache from before the bench tools (server built, sources unpacked) is completed:
    no download, one configure and one build of every target."""
    layout = BuildLayout(tmp_path, "9.9.9")
    _executable(layout.binary)
    layout.sdist_dir.mkdir(parents=True)
    (layout.sdist_dir / "llama_cpp_python-9.9.9.tar.gz").write_bytes(b"")
    layout.llama_cpp_dir.mkdir(parents=True)
    calls: list[list[str]] = []
    monkeypatch.setattr(llama_server, "_run", _recording_run(layout, calls))
    assert llama_server.build("9.9.9", tmp_path, jobs=1, say=lambda _: None) == layout.binary
    assert calls == [
        cmake_configure_command(layout.llama_cpp_dir, layout.build_dir),
        cmake_build_command(layout.build_dir, 1),
    ]
    assert layout.missing() == []
