"""Building a kernel: a builder killed mid-compile never blocks the next one."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.extension import build_lock, isa_for
from kernels.layer_ops import layer_ops_available

# Loads layer_ops in a fresh process and prints where torch keeps its build.
LOAD = """
from torch.utils.cpp_extension import _get_build_directory
from kernels.extension import isa_flags, source_digest
import kernels.layer_ops as ops
assert ops.layer_ops_available()
ext = ops._EXTENSION
name = f"pdserve_{ext.stem}_{isa_flags()[0]}_{source_digest(ext.source)}"
print(_get_build_directory(name, False))
"""


def test_a_lock_file_left_by_a_killed_builder_does_not_block_the_next_load() -> None:
    if not layer_ops_available():
        pytest.fail("layer_ops does not build here; the kernels' own tests say why")
    build_dir = Path(subprocess.run([sys.executable, "-c", LOAD], check=True, text=True,
                                    capture_output=True, timeout=600).stdout.strip())  # fmt: skip
    stale = build_dir / "lock"
    stale.touch()  # what torch leaves when its builder is SIGKILLed between lock and release
    try:
        # torch alone would wait for this file forever: the deadline is the test's.
        subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True, timeout=120)
    finally:
        stale.unlink(missing_ok=True)
    assert not stale.exists()


def test_a_live_builder_is_waited_for_within_a_deadline(tmp_path: Path) -> None:
    with open(tmp_path / "pdserve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another builder, alive
        (tmp_path / "lock").touch()  # its torch lock file, not stale
        with pytest.raises(TimeoutError, match="another process"), build_lock(tmp_path, 0.5):
            pass
        assert (tmp_path / "lock").exists()
    with build_lock(tmp_path, 0.5):  # released (as by its holder's death): taken at once
        assert not (tmp_path / "lock").exists()


def test_the_isa_of_a_build_follows_the_cpu_flags() -> None:
    assert isa_for({"sse2"}) == ("generic", [])
    name, flags = isa_for({"avx2", "fma", "f16c"})
    assert name == "avx2" and "-mavx2" in flags and not any("avx512" in f for f in flags)
    # AVX-512 without VL (no 32 registers for 256-bit code) builds the AVX2 kernel
    assert isa_for({"avx2", "fma", "f16c", "avx512f"})[0] == "avx2"
    name, flags = isa_for({"avx2", "fma", "f16c", "avx512f", "avx512vl"})
    assert name == "avx512" and {"-mavx2", "-mavx512vl", "-mprefer-vector-width=256"} <= set(flags)
